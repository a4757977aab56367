"""The naive baseline: HF transformers `generate` in-process on the same GGUF (float32).

This is what a user gets with no serving engine at all: one static batch, padded, no paged KV
cache, no streaming. Prompts are the benchmark's own random prompts (same seed, same exact
lengths), so every sequence in a batch has the same length and no padding is needed. Run as its
own process by `bench compare`, which samples its memory:

    python -m llmbus.bench.hf_baseline --batch-sizes 1,16 --input-len 256 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def load_model(path: Path, dtype_name: str = "float32", device: str = "cpu"):
    """HF transformers' LlamaForCausalLM from the GGUF (transformers dequantizes it)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype_name))
    return model.to(device).eval()


def measure(model, prompt_ids: list[list[int]], max_tokens: int,
            eos_token_id: int) -> tuple[dict, list[list[int]]]:
    """Prefill time (a 1-token generate) and a full greedy generate of `max_tokens` past EOS.

    Returns the stats and the generated token ids of each prompt.
    """
    import torch

    batch = torch.tensor(prompt_ids, device=model.device)  # [B, S], all the same length
    kwargs = dict(do_sample=False, pad_token_id=eos_token_id, eos_token_id=eos_token_id,
                  attention_mask=torch.ones_like(batch))
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(batch, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             **kwargs)
        total = time.perf_counter() - start
    num_output = (out.shape[1] - batch.shape[1]) * batch.shape[0]
    stats = {"batch_size": batch.shape[0], "input_len": batch.shape[1],
            "output_tokens": num_output, "duration_s": total,
            "output_throughput": num_output / total, "prefill_ms": prefill * 1000,
            "decode_step_ms": (total - prefill) / max(max_tokens - 1, 1) * 1000}
    return stats, out[:, batch.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="GGUF model (default: the default model)")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args(argv)

    import torch
    import transformers

    from llmbus.bench.datasets import random_dataset
    from llmbus.services.gguf_tokenizer import GGUFTokenizer
    from llmbus.services.model_files import default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.gguf) if args.gguf else default_model_path()
    tokenizer = GGUFTokenizer.from_gguf(path)
    start = time.perf_counter()
    model = load_model(path)
    load_s = time.perf_counter() - start
    runs = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        dataset = random_dataset(tokenizer, num_requests=batch_size, input_len=args.input_len,
                                 seed=args.seed)
        prompt_ids = [tokenizer.encode(r.prompt or "") for r in dataset]
        runs.append(measure(model, prompt_ids, args.max_tokens, tokenizer.eos_token_id)[0])
        print(f"batch {batch_size}: {runs[-1]['output_throughput']:.1f} output tok/s",
              file=sys.stderr)
    result = {"transformers": transformers.__version__, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "dtype": "float32", "load_s": load_s,
              "runs": runs}
    text = json.dumps(result, indent=2)
    if args.result_json:
        Path(args.result_json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
