"""A thinking qwen3 model served by `llmbus up --model`: its reasoning comes back as
`reasoning_content`, its answer as `content`, streamed and not, read by the openai SDK; also
where the prompt itself opened the think block (DeepSeek-R1's template ends in `<think>`).
`chat_template_kwargs` reach the template (`enable_thinking: false` closes the block).

The model is generated, not random: one layer whose attention and MLP add nothing, so each
next token depends on the last one alone, and a head that maps each token of a script to the
next. Greedy decoding then writes the script, `<think>Let me think</think>` then `Paris.`,
through the real executor (fast mode, Q8_0 weights), scheduler, detokenizer and api. (A model
this simple cannot tell that thinking was turned off: that case is checked in the prompt.)
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from llmbus.services.gguf_metadata import read_metadata
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.model_files import default_model_path
from tests.stack import needs_default_model, start_stack, stop_stack

pytestmark = [pytest.mark.model, needs_default_model()]

USER_DEFINED = 4  # llama.cpp's token type of added, non-special tokens (<think> in Qwen3)
# Qwen3's chat template as it ends a conversation: thinking off writes an empty think block;
# `opened` ends the prompt inside one, as DeepSeek-R1's template does.
TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content"
    " + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is"
    " false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if opened is defined and opened %}{{ '<think>' }}{%- endif %}{%- endif %}")
REASONING, ANSWER = "Let me think", "Paris."
SCRIPT = f"\n<think>{REASONING}</think>{ANSWER}"  # from the prompt's last token on
HIDDEN = 64


def _write_thinking_qwen3(path) -> None:
    import gguf

    meta = read_metadata(default_model_path())
    tokens = [*meta["tokenizer.ggml.tokens"], "<think>", "</think>"]
    types = [*meta["tokenizer.ggml.token_type"], USER_DEFINED, USER_DEFINED]
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    eos = meta["tokenizer.ggml.eos_token_id"]
    writer.add_eos_token_id(eos)
    writer.add_chat_template(TEMPLATE)
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    vocab = len(tokens)
    rng = np.random.default_rng(0)
    embed = (0.01 * rng.standard_normal((vocab, HIDDEN))).astype(np.float32)
    head = np.zeros((vocab, HIDDEN), np.float32)
    chain = [*_script_ids(tokens, types, meta), eos]
    assert len(set(chain)) == len(chain) <= HIDDEN, chain  # each token has one successor
    for i, (token, successor) in enumerate(zip(chain, chain[1:], strict=False)):
        embed[token] = 0.0
        embed[token, i] = 1.0
        head[successor, i] = 10.0  # its logit ~80 after the norm; every other about 0
    dh, zeros = HIDDEN // 4, np.zeros
    tensors = {"token_embd.weight": embed, "output.weight": head,
               "output_norm.weight": np.ones(HIDDEN, np.float32),
               "blk.0.attn_norm.weight": np.ones(HIDDEN, np.float32),
               "blk.0.attn_q.weight": 0.1 * rng.standard_normal((4 * dh, HIDDEN)),
               "blk.0.attn_k.weight": 0.1 * rng.standard_normal((2 * dh, HIDDEN)),
               "blk.0.attn_v.weight": 0.1 * rng.standard_normal((2 * dh, HIDDEN)),
               "blk.0.attn_q_norm.weight": np.ones(dh, np.float32),
               "blk.0.attn_k_norm.weight": np.ones(dh, np.float32),
               "blk.0.attn_output.weight": zeros((HIDDEN, 4 * dh), np.float32),
               "blk.0.ffn_norm.weight": np.ones(HIDDEN, np.float32),
               "blk.0.ffn_gate.weight": 0.1 * rng.standard_normal((128, HIDDEN)),
               "blk.0.ffn_up.weight": 0.1 * rng.standard_normal((128, HIDDEN)),
               "blk.0.ffn_down.weight": zeros((HIDDEN, 128), np.float32)}
    for name, array in tensors.items():
        array = np.asarray(array, np.float32)
        if array.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _script_ids(tokens, types, meta) -> list[int]:
    """SCRIPT's token ids under the file's vocabulary and added tokens: the chain the served
    prompt ends and the output goes on with."""
    tokenizer = GGUFTokenizer(
        tokens=tokens, token_types=types, merges=meta["tokenizer.ggml.merges"],
        model=meta["tokenizer.ggml.model"], pre=meta["tokenizer.ggml.pre"],
        bos_token_id=meta["tokenizer.ggml.bos_token_id"],
        eos_token_id=meta["tokenizer.ggml.eos_token_id"])
    return tokenizer.encode(SCRIPT)


@pytest.fixture(scope="module")
def thinking_stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking")
    path = folder / "thinking-qwen3.gguf"
    _write_thinking_qwen3(path)
    stack = start_stack(folder, "--model", str(path), "--no-nats-auth")
    yield stack
    stop_stack(stack)


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_reasoning_and_answer_come_apart(thinking_stack):
    client = _client(thinking_stack)
    [model] = client.models.list().data
    reply = client.chat.completions.create(model=model.id, messages=QUESTION, temperature=0,
                                           max_tokens=30)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)
    assert reply.choices[0].finish_reason == "stop"


def test_reasoning_streams_before_the_answer(thinking_stack):
    client = _client(thinking_stack)
    [model] = client.models.list().data
    parts = []
    for chunk in client.chat.completions.create(model=model.id, messages=QUESTION,
                                                temperature=0, max_tokens=30, stream=True):
        delta = chunk.choices[0].delta
        for field in ("reasoning_content", "content"):
            if getattr(delta, field, None):
                parts.append((field, getattr(delta, field)))
    fields = [field for field, _ in parts]
    assert fields == sorted(fields, key=("reasoning_content", "content").index)  # in order
    assert "".join(t for f, t in parts if f == "reasoning_content") == REASONING
    assert "".join(t for f, t in parts if f == "content") == ANSWER
    assert not any("think>" in t for _, t in parts)


def test_a_prompt_that_opened_the_think_block(thinking_stack):
    client = _client(thinking_stack)
    [model] = client.models.list().data
    reply = client.chat.completions.create(
        model=model.id, messages=QUESTION, temperature=0, max_tokens=30,
        extra_body={"chat_template_kwargs": {"opened": True}})
    message = reply.choices[0].message  # the output begins inside the block: no <think>
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)


def test_chat_template_kwargs_reach_the_template(thinking_stack):
    base = thinking_stack.base_url.removesuffix("/v1")

    def prompt(**kwargs) -> str:
        tokens = httpx.post(f"{base}/tokenize", timeout=30, json={
            "messages": QUESTION, **kwargs}).json()["tokens"]
        return httpx.post(f"{base}/detokenize", timeout=30,
                          json={"tokens": tokens}).json()["prompt"]

    # (decoded without the special tokens: <|im_start|> is one, <think> is not)
    assert prompt().endswith("France?\nassistant\n")
    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith(
        "France?\nassistant\n<think>\n\n</think>\n\n")
    refused = httpx.post(f"{base}/tokenize", timeout=30, json={
        "messages": QUESTION, "chat_template_kwargs": {"messages": []}})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "`chat_template_kwargs` may not set `messages`"


def test_structured_output_constrains_the_answer_not_the_reasoning(thinking_stack):
    """A choice constraint on a thinking model: the reasoning is written freely, the answer
    after `</think>` is one of the choices; with thinking off (the template closed the think
    block) the constraint holds from the first token."""
    client = _client(thinking_stack)
    [model] = client.models.list().data
    choices = {"guided_choice": ["Paris", "Rome"]}
    reply = client.chat.completions.create(model=model.id, messages=QUESTION, temperature=0,
                                           max_tokens=30, extra_body=choices)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, "Paris")
    off = client.chat.completions.create(
        model=model.id, messages=QUESTION, temperature=0, max_tokens=30,
        extra_body={**choices, "chat_template_kwargs": {"enable_thinking": False}})
    message = off.choices[0].message
    assert message.reasoning_content is None and message.content in ("Paris", "Rome")
