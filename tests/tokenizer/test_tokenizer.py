"""The GGUF tokenizer and chat template, against transformers on the default model."""

from __future__ import annotations

import gguf
import pytest

from llmbus.services.gguf_tokenizer import (
    GGUFTokenizer,
    UnsupportedTokenizerError,
    byte_alphabet,
)
from llmbus.services.model_files import default_model_path
from llmbus.services.tokenizer.chat_template import ChatTemplateError, render_chat_template
from tests.gguf_fixtures import tiny_tokenizer

MODEL_PATH = default_model_path()

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    " 123 4.56e-7 x1y22 2024-01-31 3,141,592",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    'if (a != b && c >= 0) { printf("%d\\n", a); }',
    "😀 emoji 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Café naïve résumé Ångström Straße ñandú",
    "tabs\tand  double  spaces   and\n\nnewlines \n \r\n trailing   ",
    "    leading spaces",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 😀"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in 日本語?"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer() -> GGUFTokenizer:
    if not MODEL_PATH.is_file():
        pytest.skip(f"default model missing: {MODEL_PATH}")
    return GGUFTokenizer.from_gguf(MODEL_PATH)


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_PATH.parent),
                                                      gguf_file=MODEL_PATH.name)


@pytest.mark.model
def test_metadata(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.bos_token) == (1, "<|im_start|>")
    assert (tokenizer.eos_token_id, tokenizer.eos_token) == (2, "<|im_end|>")
    assert tokenizer.add_bos_token is False
    assert tokenizer.special_token_ids == frozenset(range(17))
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.convert_ids_to_tokens([1, 216, 33]) == ["<|im_start|>", "Ġ", "1"]


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert hf_tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.model
def test_special_tokens_in_text(tokenizer):
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tokenizer.decode([1, 4093, 198, 6004, 2]) == "user\nhi"


@pytest.mark.model
def test_digits_split_one_by_one(tokenizer):
    assert tokenizer.encode("12345") == [33, 34, 35, 36, 37]
    # As the model's tokenizer.json and llama.cpp split them; transformers' GGUF loader has no
    # Digits step and gives [3351, 138] here (ASCII digits agree either way).
    assert tokenizer.encode(" ½") == [216, 16738]


@pytest.mark.model
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages,
                                            add_generation_prompt):
    prompt = render_chat_template(tokenizer.chat_template, messages,
                                  add_generation_prompt=add_generation_prompt,
                                  bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    assert prompt == expected
    assert tokenizer.encode(prompt) == hf_tokenizer.encode(prompt, add_special_tokens=False)


@pytest.mark.model
def test_default_chat_prompt(tokenizer):
    prompt = render_chat_template(tokenizer.chat_template, CONVERSATIONS[0],
                                  add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_chat_template_helpers():
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}"
        "{{ bos_token }}{{ ns.n }}{% if tools is none %}!{% endif %}"
    )
    messages = [{"role": "user", "content": "é<>", "tool_calls": None}]
    # trim_blocks eats the newline after a block tag; tojson neither escapes HTML nor non-ASCII.
    assert render_chat_template(template, messages) == '{"role": "user", "content": "é<>"}1!'
    with pytest.raises(ChatTemplateError, match="user first"):
        render_chat_template(template, [{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ ''.__class__ }}{{ x.__class__.__mro__ }}", [], x=1)
    with pytest.raises(ChatTemplateError, match="compile"):
        render_chat_template("{% for %}", [])


def test_tiny_vocabulary_without_a_model_file():
    tok = tiny_tokenizer()
    hello = tok.encode("hello")
    assert tok.convert_ids_to_tokens(hello) == ["hello"]
    assert tok.encode("hello", add_special_tokens=True) == [0, *hello]
    assert tok.encode("hello</s>")[-1] == 1
    text = "hello 😀 wörld 42"
    assert tok.decode(tok.encode(text + "</s>")) == text
    assert tok.decode(tok.encode("😀")[:2]).endswith("\ufffd")


# Digits in runs, contractions, newlines and spaces of every kind, NFC-sensitive letters: where
# the pre-tokenizers of the families differ.
SPLIT_TEXT = ("It's 2024-11-30; I'M here, we'LL see.\n\n  Ünïcödé café (cafe\u0301) 日本語テキスト "
              "1234567 89 ½ ²³ 😀👍🏽\t tabs   spaces\r\nend  \n  x")


@pytest.fixture(scope="module")
def vocab_files(tokenizer, tmp_path_factory):
    """The default model's byte-level vocabulary and merges as vocab.json / merges.txt."""
    import json

    from gguf import GGUFReader

    fields = GGUFReader(MODEL_PATH).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = fields["tokenizer.ggml.merges"].contents()
    folder = tmp_path_factory.mktemp("vocab")
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return tokens, merges, folder


def _with_pre(tokens: list[str], merges: list[str], pre: str) -> GGUFTokenizer:
    return GGUFTokenizer(tokens=tokens, token_types=[1] * len(tokens), merges=merges,
                         bos_token_id=None, eos_token_id=None, pre=pre)


@pytest.mark.model
@pytest.mark.parametrize("pre,hf_class", [("gpt2", "GPT2Tokenizer"),
                                          ("qwen2", "Qwen2Tokenizer")])
def test_pre_tokenizers_match_transformers(vocab_files, pre, hf_class):
    """Each family's split (`tokenizer.ggml.pre`) against transformers' own Python
    tokenizer of that family, on the same vocabulary and merges."""
    transformers = pytest.importorskip("transformers")
    tokens, merges, folder = vocab_files
    hf = getattr(transformers, hf_class)(str(folder / "vocab.json"), str(folder / "merges.txt"))
    ours = _with_pre(tokens, merges, pre)
    for text in (SPLIT_TEXT, *(t for t in TEXTS if "<|" not in t)):  # no special tokens here
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text


@pytest.mark.model
def test_llama3_split_follows_its_published_pattern(vocab_files):
    """transformers has no Python Llama 3 tokenizer: its words are checked against the
    `regex` module running the pattern of Llama 3's tokenizer.json, and they differ from
    GPT-2's and Qwen2's where they should (digits in threes)."""
    import regex

    from llmbus.services.gguf_tokenizer import _LLAMA3_WORDS

    tokens, merges, _ = vocab_files
    spell = byte_alphabet()
    ours = _with_pre(tokens, merges, "llama-bpe").backend.pre_tokenizer
    for text in (SPLIT_TEXT, *TEXTS):
        words = [w for w, _ in ours.pre_tokenize_str(text)]
        expected = ["".join(spell[b] for b in w.encode()) for w in
                    regex.findall(_LLAMA3_WORDS, text)]
        assert words == expected, text
    pieces = {pre: [w for w, _ in _with_pre(tokens, merges, pre).backend.pre_tokenizer
                    .pre_tokenize_str("1234567")] for pre in ("llama-bpe", "qwen2", "gpt2")}
    assert pieces == {"llama-bpe": ["123", "456", "7"], "qwen2": list("1234567"),
                      "gpt2": ["1234567"]}


def test_a_file_names_its_pre_tokenizer(tmp_path):
    """`tokenizer.ggml.pre` in the file picks the split (here Llama 3's digits in threes)."""
    alphabet = byte_alphabet()
    path = tmp_path / "llama3-like.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list([alphabet[b] for b in range(256)])
    writer.add_token_merges([])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    split = GGUFTokenizer.from_gguf(path).backend.pre_tokenizer.pre_tokenize_str("1234567")
    assert [w for w, _ in split] == ["123", "456", "7"]


def test_rejects_a_pre_tokenizer_it_does_not_build(tmp_path):
    """A file whose byte-level BPE splits text in a way not built here (`tokenizer.ggml.pre`)
    would get wrong ids silently, so it is refused by name."""
    path = tmp_path / "deepseek-like.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-llm")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedTokenizerError,
                       match=r"'deepseek-llm' \(tokenizer.ggml.pre\)"):
        GGUFTokenizer.from_gguf(path)
