"""SentencePiece-style GGUF vocabularies (Llama 2, Mistral, Gemma 3: `tokenizer.ggml.model`
llama): ids equal HF transformers' on the same file, for multilingual text, digits, whitespace
and characters only byte fallback can spell; text decodes back."""

from __future__ import annotations

import gguf
import pytest

from llmbus.services.gguf_tokenizer import GGUFTokenizer, UnsupportedTokenizerError

pytest.importorskip("transformers")

SPACE = "\u2581"
TEXTS = [
    "Hello world, the thing is 12345!",
    "  leading spaces,\ttabs\nand new lines  ",
    "Ünïcödé café: naïve façade, jalapeño",
    "日本語のテキスト and emoji 🙂 then text",
    "the theater then there: in and on, 1 2 3 10 100",
    "abc xyz abcxyz",  # two ways to merge each: the scores decide
    "",
]
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


def test_a_gemma_vocabulary_equals_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "gemma.gguf"
    write_gemma_vocab(path)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert type(theirs).__name__ == "GemmaTokenizer"
    ours = GGUFTokenizer.from_gguf(path)
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello world "}]
    for text in [*TEXTS, "<start_of_turn>user\nthe text<end_of_turn>\n", "a\n\n  b"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text), text
    from llmbus.services.tokenizer.chat_template import render_chat_template

    rendered = render_chat_template(ours.chat_template, chat, add_generation_prompt=True,
                                    bos_token=ours.bos_token, eos_token=ours.eos_token)
    assert rendered == theirs.apply_chat_template(chat, tokenize=False,
                                                  add_generation_prompt=True)
    assert rendered == ("<bos><start_of_turn>user\nBe brief.\n\nhello world<end_of_turn>\n"
                        "<start_of_turn>model\n")


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_vocab(path)
    return path


def test_ids_equal_transformers(vocab_file):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(vocab_file.parent, gguf_file=vocab_file.name)
    ours = GGUFTokenizer.from_gguf(vocab_file)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text), text


def test_text_decodes_back_through_pieces_and_bytes(vocab_file):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(vocab_file.parent, gguf_file=vocab_file.name)
    tokenizer = GGUFTokenizer.from_gguf(vocab_file)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        if not text.startswith(" "):  # a leading space merges into the prefix one, as in HF
            assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("abc xyz"))[-3:] == [
        SPACE, "x", "yz"]  # yz outscores xy
    emoji = tokenizer.encode("🙂")  # no piece spells it: its four UTF-8 bytes
    assert tokenizer.convert_ids_to_tokens(emoji)[-4:] == ["<0xF0>", "<0x9F>", "<0x99>",
                                                           "<0x82>"]
    assert tokenizer.add_bos_token and tokenizer.bos_token == "<s>"


def test_a_vocabulary_without_scores_or_of_another_kind_is_refused(tmp_path):
    write_vocab(tmp_path / "no-scores.gguf", scores=False)
    with pytest.raises(UnsupportedTokenizerError, match="tokenizer.ggml.scores"):
        GGUFTokenizer.from_gguf(tmp_path / "no-scores.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[UNK]", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedTokenizerError, match="'bert' \\(tokenizer.ggml.model\\)"):
        GGUFTokenizer.from_gguf(tmp_path / "bert.gguf")


def test_streamed_text_is_the_whole_text(vocab_file):
    """The detokenizer's windows keep SentencePiece's spaces: a bare window's leading space
    would be stripped, as the first token of a text's is."""
    from llmbus.services.detokenizer.incremental import IncrementalDetokenizer

    tokenizer = GGUFTokenizer.from_gguf(vocab_file)
    prompt = tokenizer.encode("the", add_special_tokens=True)
    for text in TEXTS[:5]:
        ids = tokenizer.encode(" " + text)[1:]  # as generated after the prompt
        detokenizer = IncrementalDetokenizer(tokenizer.decode, prompt_ids=prompt)
        streamed = "".join(detokenizer.step([i]).text for i in ids)
        assert streamed == tokenizer.decode(prompt + ids)[len("the"):], text


def test_add_eos_and_the_space_prefix_follow_the_file(tmp_path):
    """As llama.cpp reads the file; transformers' GGUF loader ignores add_space_prefix."""
    path = tmp_path / "eos.gguf"
    write_vocab(path, add_space_prefix=False, add_eos=True)
    tokenizer = GGUFTokenizer.from_gguf(path)
    ids = tokenizer.encode("the world", add_special_tokens=True)
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.convert_ids_to_tokens(ids[1:-1]) == ["the", SPACE + "world"]
    assert tokenizer.decode(ids) == "the world"
