"""xgrammar against llguidance on the default model's vocabulary: what choosing the structured
output library was measured on (docs/benchmarks.md, "Structured output").

For each library installed: the time to compile a 20-property JSON schema (the tokenizer's own
preparation is reported apart, it is paid once per process), then the time to compute the token
masks of 16 requests that each write a valid instance of that schema, per step. Both fill the
same int32 bitmask layout, so the step cost is comparable as is.

    python -m llmbus.bench.grammar_libraries [--batch 16] [--steps 64]

Neither library is needed at run time but llguidance (the one llmbus uses); install xgrammar
with `pip install --no-deps xgrammar apache-tvm-ffi` to compare.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.model_files import default_model_path

ENUM = ["red", "green", "blue", "black"]


def twenty_property_schema() -> dict:
    """Strings, integers with bounds, numbers, booleans, enums, arrays and a nested object."""
    properties: dict[str, dict] = {}
    for i in range(20):
        kind = i % 6
        properties[f"field_{i}"] = (
            {"type": "string", "maxLength": 24} if kind == 0
            else {"type": "integer", "minimum": 0, "maximum": 1000} if kind == 1
            else {"type": "number"} if kind == 2
            else {"type": "boolean"} if kind == 3
            else {"enum": ENUM} if kind == 4
            else {"type": "array", "items": {"type": "string"}, "maxItems": 3})
    properties["field_19"] = {"type": "object", "properties": {
        "name": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["name", "count"], "additionalProperties": False}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def instance(i: int) -> str:
    values = {}
    for k in range(20):
        kind = k % 6
        values[f"field_{k}"] = (f"text {i} {k}" if kind == 0 else (i * 37 + k) % 1000 if kind == 1
                                else i + k / 8 if kind == 2 else bool((i + k) % 2) if kind == 3
                                else ENUM[(i + k) % 4] if kind == 4 else [f"x{i}", "y"])
    values["field_19"] = {"name": f"n{i}", "count": i}
    return json.dumps(values)  # in the schema's order, which both libraries keep


def bench_llguidance(tokenizer: GGUFTokenizer, schema: dict, texts: list[list[int]],
                     batch: int) -> dict:
    import llguidance
    import llguidance.torch as lltorch

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                   eos_token=tokenizer.eos_token_id)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matchers = [llguidance.LLMatcher(lltok, grammar, log_level=0) for _ in range(batch)]
    t2 = time.perf_counter()
    assert not matchers[0].is_error(), matchers[0].get_error()
    executor = llguidance.LLExecutor(num_threads=1)
    bitmask = lltorch.allocate_token_bitmask(batch, tokenizer.vocab_size)
    step_seconds = []
    for pos in range(min(len(t) for t in texts)):
        start = time.perf_counter()
        lltorch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)],
                                            bitmask)
        step_seconds.append(time.perf_counter() - start)
        for i, m in enumerate(matchers):
            assert m.consume_token(texts[i][pos]), m.get_error()
    return {"tokenizer_s": t1 - t0, "compile_s": (t2 - t1) / batch, "steps": step_seconds}


def bench_xgrammar(tokenizer: GGUFTokenizer, schema: dict, texts: list[list[int]],
                   batch: int) -> dict:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size,
                                                   stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    t2 = time.perf_counter()
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgrammar.allocate_token_bitmask(batch, tokenizer.vocab_size)
    step_seconds = []
    for pos in range(min(len(t) for t in texts)):
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        step_seconds.append(time.perf_counter() - start)
        for i, m in enumerate(matchers):
            assert m.accept_token(texts[i][pos])
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "steps": step_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64, help="tokens of each instance timed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = GGUFTokenizer.from_gguf(default_model_path())
    schema = twenty_property_schema()
    texts = [tokenizer.encode(instance(i))[:args.steps] for i in range(args.batch)]
    print(f"20-property schema, batch {args.batch}, {len(texts[0])} tokens per instance, "
          f"vocabulary {tokenizer.vocab_size}")
    for name, run in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            result = run(tokenizer, schema, texts, args.batch)
        except ImportError as exc:
            print(f"{name:<11} not installed ({exc.name})")
            continue
        steps = sorted(result["steps"])
        print(f"{name:<11} tokenizer {result['tokenizer_s'] * 1e3:7.1f} ms   "
              f"compile {result['compile_s'] * 1e3:7.2f} ms   "
              f"mask per step p50 {steps[len(steps) // 2] * 1e3:6.3f} ms   "
              f"max {steps[-1] * 1e3:6.3f} ms   mean {sum(steps) / len(steps) * 1e3:6.3f} ms")


if __name__ == "__main__":
    main()
