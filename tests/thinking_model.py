"""A generated thinking qwen3 model for the tests of reasoning output (chat, Responses,
Messages).

Not random: one layer whose attention and MLP add nothing, so each next token depends on the
last one alone, and a head that maps each token of a script to the next. Greedy decoding then
writes the script, `<think>Let me think</think>` then `Paris.`, through the real executor
(fast mode, Q8_0 weights), scheduler, detokenizer and api, whatever the prompt says before its
last token (a chat prompt ends in `assistant\n`). A model this simple cannot tell that thinking
was turned off: that case is checked in the prompt.
"""

from __future__ import annotations

import numpy as np

from llmbus.services.gguf_metadata import read_metadata
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.model_files import default_model_path
from tests.gguf_fixtures import write_tensors

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


def write_thinking_qwen3(path) -> None:
    """The thinking model (see the module's docstring) as a GGUF at `path`."""
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
    chain = [*script_ids(tokens, types, meta), eos]
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
    write_tensors(writer, tensors, "Q8_0")


def script_ids(tokens, types, meta) -> list[int]:
    """SCRIPT's token ids under the file's vocabulary and added tokens: the chain the served
    prompt ends and the output goes on with."""
    tokenizer = GGUFTokenizer(
        tokens=tokens, token_types=types, merges=meta["tokenizer.ggml.merges"],
        model=meta["tokenizer.ggml.model"], pre=meta["tokenizer.ggml.pre"],
        bos_token_id=meta["tokenizer.ggml.bos_token_id"],
        eos_token_id=meta["tokenizer.ggml.eos_token_id"])
    return tokenizer.encode(SCRIPT)
