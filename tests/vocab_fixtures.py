"""Small SentencePiece-style GGUF vocabularies in the real format (Llama's and Gemma 3's), for
the tokenizer's tests and the model-family stacks."""

from __future__ import annotations

import gguf

SPACE = "\u2581"
WORDS = ["the", "then", "there", "theater", "hello", "world", "thing", "is", "and", "on", "in",
         "text", "café", "new", "lines", "spaces", "tabs", "leading", "emoji"]


def write_vocab(path, *, scores: bool = True, add_space_prefix: bool | None = None,
                add_eos: bool | None = None) -> None:
    """A small real-format SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens,
    characters, then pieces of words (with and without a leading space) in score order."""
    pieces = [SPACE, *"abcdefghijklmnopqrstuvwxyzHTWÜïöéçñ,.:!0123456789日本"]
    for word in WORDS:
        for start in (SPACE + word, word):
            for end in range(2, len(start) + 1):
                if start[:end] not in pieces:
                    pieces.append(start[:end])
    pieces += ["12", "123", "10", "100", "ab", "yz", "bc", "xy"]  # ab beats bc, yz beats xy
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    # characters score below every longer piece; longer pieces score higher here, as trained
    # vocabularies roughly do, with no two alike
    piece_scores = [-1000.0 - i if len(p) == 1 else -float(i) / 10 - 1.0 / len(p)
                    for i, p in enumerate(pieces)]
    assert set("abcxyz") <= set(pieces) and "abc" not in pieces and "xyz" not in pieces
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    if scores:
        writer.add_token_scores([0.0, 0.0, 0.0, *([0.0] * 256), *piece_scores])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GEMMA_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_TEMPLATE = (  # Gemma 3's, its system message folded into the first user turn
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first = "
    "messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}"
    "{%- set first = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}{{ '<start_of_turn>' + ('model' if message['role'] =="
    " 'assistant' else message['role']) + '\\n' + (first if loop.first else '') + "
    "message['content'] | trim + '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")


def write_gemma_vocab(path) -> int:
    """Gemma 3's vocabulary as its GGUF holds it, small: `pre` default, no space prefix (a
    word's leading space is its own piece), BOS added, <pad> <eos> <bos> <unk> and the turn
    markers as control tokens, pieces for newlines and runs of spaces; returns its size."""
    pieces = [SPACE, *"abcdefghijklmnopqrstuvwxyzHTWÜïöéçñ,.:!0123456789日本", "\n", "\t",
              SPACE * 2]
    for word in WORDS:
        for start in (SPACE + word, word):
            for end in range(2, len(start) + 1):
                if start[:end] not in pieces:
                    pieces.append(start[:end])
    pieces += ["12", "123", "10", "100", "ab", "yz", "bc", "xy"]
    tokens = [*GEMMA_CONTROL, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [3, 3, 3, 2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    scores = [0.0] * (len(GEMMA_CONTROL) + 256) + [
        -1000.0 - i if len(p) == 1 else -float(i) / 10 - 1.0 / len(p)
        for i, p in enumerate(pieces)]
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
    writer.add_chat_template(GEMMA_TEMPLATE)
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                       (writer.add_embedding_length, 8), (writer.add_head_count, 1)):
        add(value)  # what transformers needs to read the file's config
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(tokens)
