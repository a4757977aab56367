"""The executor's backend choice (backend_choice.py): which backend runs for which options, CPU
and file, and the one line it is logged as; the CPU facts it rests on; the old `--engine`
spelling of `--backend`."""

from __future__ import annotations

import argparse
from dataclasses import replace

import gguf
import pytest

from llmbus.services import cpu_features
from llmbus.services.executor.backend_choice import choose_backend
from llmbus.services.executor.kernels.cpu import library
from llmbus.services.executor.options import add_arguments
from llmbus.services.executor.service import backend_choice_for
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.gguf_quants import native_parsers
from llmbus.services.executor.weights.matrices import NATIVE_GGML_TYPES, kernel_takes_file
from llmbus.services.executor.weights.quant_parts import kernel_takes
from tests.gguf_fixtures import TinySpec, write_tiny_llama

needs_compiler = pytest.mark.skipif(library.load_library() is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, object]:
    """Tiny files the integer kernel takes (Q4_1, Q8_0) and does not (float32 matrices; a
    vocabulary of 250, no whole column groups of 8)."""
    folder = tmp_path_factory.mktemp("choice")
    made = {}
    for name, spec, quantized in (("q4_1", TinySpec(), "Q4_1"), ("q8_0", TinySpec(), "Q8_0"),
                                  ("f32", TinySpec(), None),
                                  ("v250", replace(TinySpec(), vocab_size=250), "Q4_1")):
        made[name] = folder / f"{name}.gguf"
        write_tiny_llama(made[name], spec, quantized=quantized)
    return made


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(argv)


def test_the_native_types_are_those_with_a_parser():
    assert {gguf.GGMLQuantizationType[t] for t in NATIVE_GGML_TYPES} == set(native_parsers(gguf))


@pytest.mark.parametrize("name", ["q4_1", "q8_0", "f32", "v250"])
def test_the_header_tells_what_the_load_would(files, name):
    config, _, native = load_gguf(files[name], keep_native=True, dense_for_native=False)
    assert kernel_takes_file(files[name]) == kernel_takes(config, native)
    assert kernel_takes_file(files[name]) == (name in ("q4_1", "q8_0"))


@needs_compiler
def test_the_fast_mode_runs_the_integer_kernel_and_exact_the_graphs(files):
    choice = choose_backend(files["q4_1"])
    assert (choice.backend, choice.kv_dtype, choice.exact) == ("integer-kernel", "float16",
                                                               False)
    assert choice.describe() == (f"integer kernel ({library.build_label()}) + C++ paged "
                               "attention, float16 KV, fast mode")
    exact = choose_backend(files["q4_1"], exact=True)
    assert exact.describe() == ("ONNX Runtime graphs (float32 activations) + C++ paged "
                                "attention, float32 KV, exact mode")
    args = _args("--model", str(files["q4_1"]))
    assert backend_choice_for(args, cuda_available=False) == choice


@needs_compiler
def test_a_file_the_kernel_does_not_take_runs_the_graphs_and_says_why(files):
    for name in ("f32", "v250"):
        choice = choose_backend(files[name])
        assert (choice.backend, choice.kv_dtype) == ("onnxruntime", "float16")
        assert choice.describe().endswith(
            "fast mode (no integer kernel: the file has matrices it does not take)")
        with pytest.raises(ValueError, match="does not take"):
            choose_backend(files[name], backend="integer-kernel")
    with pytest.raises(ValueError, match="no exact mode"):
        choose_backend(files["q4_1"], backend="integer-kernel", exact=True)


def test_without_a_compiler_the_graphs_run_with_torch_attention(files, monkeypatch):
    monkeypatch.setattr(library, "builds", lambda isa=None: False)
    choice = choose_backend(files["q4_1"])
    assert choice.describe() == ("ONNX Runtime graphs (int8 activations) + torch attention, "
                               "float16 KV, fast mode (no integer kernel: no C++ compiler "
                               "built the CPU kernels)")
    assert choice.kernels is None


def test_torch_runs_on_cuda_and_where_forced(files):
    cuda = choose_backend(files["q4_1"], cuda_available=True)
    assert cuda.describe() == ("torch (dense float32 weights) + Triton kernels on CUDA, "
                               "float32 KV, exact mode")
    assert choose_backend(files["q4_1"], backend="torch").describe() == (
        "torch (dense float32 weights) + torch attention, float32 KV, exact mode")
    assert choose_backend(files["q4_1"], device="cpu", cuda_available=True).device == "cpu"
    assert choose_backend(files["q4_1"], dtype="float16").backend == "torch"  # a torch dtype


def test_impossible_combinations_are_refused_with_the_reason(files, monkeypatch):
    with pytest.raises(ValueError, match="compute in float32"):
        choose_backend(files["q4_1"], backend="onnxruntime", dtype="float16")
    with pytest.raises(ValueError, match="runs on the CPU"):
        choose_backend(files["q4_1"], backend="onnxruntime", cuda_available=True)
    with pytest.raises(ValueError, match="--exact computes in float32"):
        choose_backend(files["q4_1"], backend="torch", exact=True, dtype="bfloat16",
                     cuda_available=True)
    with pytest.raises(ValueError, match="unknown backend"):
        choose_backend(files["q4_1"], backend="tvm")
    monkeypatch.setattr(cpu_features, "has_native_bfloat16", lambda: False)
    with pytest.raises(ValueError, match="no native bfloat16"):
        choose_backend(files["q4_1"], dtype="bfloat16")
    assert choose_backend(files["q4_1"], dtype="bfloat16", cuda_available=True).backend == "torch"
    monkeypatch.setattr(cpu_features, "has_native_bfloat16", lambda: True)
    assert choose_backend(files["q4_1"], dtype="bfloat16").describe() == (
        "torch (dense bfloat16 weights) + torch attention, bfloat16 KV, fast mode")


def test_choosing_loads_no_kernels_so_openmp_can_still_be_configured(files):
    """libgomp reads GOMP_SPINCOUNT once, when the kernels' library loads it: the executor
    chooses its backend first, then configures OpenMP, then loads (a choice that loaded the
    library cost the exact mode a quarter of its throughput at 16 streams, its OpenMP threads
    sleeping at once between the attention's barriers)."""
    import subprocess
    import sys

    code = ("import sys; from llmbus.services.executor.backend_choice import choose_backend; "
            f"choose_backend({str(files['q4_1'])!r}); "
            "maps = open('/proc/self/maps').read(); "
            "sys.exit(1 if 'libgomp' in maps or 'llmbus-cpu-' in maps else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_build_labels_name_what_each_build_runs(monkeypatch):
    assert library.build_label("avx2") == "AVX2 build"
    assert library.build_label("generic") == "plain-loop build"
    monkeypatch.setattr(library, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert library.build_label("native") == "native build, AVX2"
    monkeypatch.setattr(library, "cpu_flags", lambda: frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512_vnni"}))
    assert library.build_label("native") == "native build, VNNI"
    monkeypatch.setattr(library, "cpu_flags", lambda: frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni",
         "amx_tile", "amx_int8"}))
    assert library.build_label("native") == (
        "native build, VNNI, AMX where a step has 16 tokens or more")


def test_cpu_summary_names_the_cpu_and_its_flags():
    summary = cpu_features.cpu_summary()
    assert summary["model"] and summary["cores"] >= 1
    assert set(summary["flags"]) <= set(cpu_features.NOTABLE_FLAGS)
    assert set(summary["flags"]) == set(cpu_features.NOTABLE_FLAGS) & cpu_features.cpu_flags()
    assert cpu_features.has_native_bfloat16() == bool(
        {"avx512_bf16", "amx_bf16"} & cpu_features.cpu_flags())
    assert str(summary["model"]) in cpu_features.cpu_label()


def test_the_new_families_get_the_backends_that_take_them(tmp_path):
    """A mixture of experts runs in the integer kernel in the fast mode and in the torch backend
    in the exact one (ONNX Runtime's graphs refused by name); Gemma 3 is not the integer
    kernel's (ONNX Runtime's graphs instead); on CUDA the Triton kernels take its windows."""
    moe, gemma = tmp_path / "moe.gguf", tmp_path / "gemma.gguf"
    write_tiny_llama(moe, TinySpec(head_size=128, num_experts=4, num_experts_used=2,
                                   expert_size=64), arch="qwen3moe", quantized="Q8_0")
    write_tiny_llama(gemma, TinySpec(head_size=256, sliding_window=8, tied=True),
                     arch="gemma3", quantized="Q8_0")
    assert kernel_takes_file(moe)
    config, _, native = load_gguf(moe, keep_native=True, dense_for_native=False)
    assert kernel_takes(config, native)
    if library.load_library() is not None:
        assert choose_backend(moe).backend == "integer-kernel"
    exact = choose_backend(moe, exact=True)
    assert (exact.backend, exact.device, exact.exact) == ("torch", "cpu", True)
    assert "mixture of experts" in exact.describe()
    with pytest.raises(ValueError, match="cannot run a mixture of experts"):
        choose_backend(moe, backend="onnxruntime")
    assert not kernel_takes_file(gemma)
    assert choose_backend(gemma).backend == "onnxruntime"
    on_cuda = choose_backend(gemma, cuda_available=True)
    assert (on_cuda.backend, on_cuda.attention) == ("torch", "Triton kernels")


def test_the_old_engine_spelling_still_chooses_the_backend(capsys):
    """`--engine` ("engine" now means a scheduler and its executor) sets `--backend`, with a
    one-line warning; `--backend` gives none."""
    assert _args("--engine", "torch").backend == "torch"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{_parser().prog}: warning: --engine is deprecated; use --backend"]
    assert _args("--backend", "onnxruntime").backend == "onnxruntime"
    assert _args().backend == "auto"
    assert capsys.readouterr().err == ""


def test_up_hands_the_old_spelling_on_as_the_new_one(capsys):
    """`llmbus up --engine X` warns once (in `up`) and starts the executor with `--backend X`
    alone; `--engine-id`, the scheduler's and executor's, is a different option."""
    from llmbus.services.cli import _argv_for, build_parser

    args = build_parser().parse_args(["up", "--engine", "onnxruntime", "--engine-id", "e3"])
    assert capsys.readouterr().err.count("--engine is deprecated; use --backend") == 1
    argv = _argv_for("executor", args)
    assert argv[argv.index("--backend") + 1] == "onnxruntime" and "--engine" not in argv
    assert argv[argv.index("--engine-id") + 1] == "e3"
    assert "--backend" not in _argv_for("executor", build_parser().parse_args(["up"]))
