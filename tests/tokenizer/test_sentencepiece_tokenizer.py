"""SentencePiece-style GGUF vocabularies (Llama 2, Mistral, Gemma 3: `tokenizer.ggml.model`
llama): ids equal HF transformers' on the same file, for multilingual text, digits, whitespace
and characters only byte fallback can spell; text decodes back."""

from __future__ import annotations

import gguf
import pytest

from llmbus.services.gguf_tokenizer import GGUFTokenizer, UnsupportedTokenizerError
from tests.vocab_fixtures import SPACE, write_gemma_vocab, write_vocab

pytest.importorskip("transformers")

TEXTS = [
    "Hello world, the thing is 12345!",
    "  leading spaces,\ttabs\nand new lines  ",
    "Ünïcödé café: naïve façade, jalapeño",
    "日本語のテキスト and emoji 🙂 then text",
    "the theater then there: in and on, 1 2 3 10 100",
    "abc xyz abcxyz",  # two ways to merge each: the scores decide
    "",
]

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
    # t5: the unigram vocabulary of xlm-roberta encoders (bge-m3), not rebuilt here
    writer = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "bert")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedTokenizerError, match="'t5' \\(tokenizer.ggml.model\\)"):
        GGUFTokenizer.from_gguf(tmp_path / "t5.gguf")


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
