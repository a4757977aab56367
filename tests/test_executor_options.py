"""The executor's backend choice from its options, and the CPU facts it rests on."""

from __future__ import annotations

import argparse

import pytest

from llmbus.services import cpu_features
from llmbus.services.executor.service import add_arguments, resolve_backend


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_pick_onnxruntime_on_the_cpu_and_torch_on_cuda():
    assert resolve_backend(_args(), cuda_available=False) == ("cpu", "onnxruntime")
    assert resolve_backend(_args(), cuda_available=True) == ("cuda", "torch")
    assert resolve_backend(_args("--backend", "torch"), cuda_available=False) == ("cpu", "torch")
    assert resolve_backend(_args("--device", "cpu"), cuda_available=True) == ("cpu",
                                                                              "onnxruntime")
    # a torch dtype other than float32 means the torch backend
    assert resolve_backend(_args("--dtype", "float16"), cuda_available=False) == ("cpu", "torch")


def test_bfloat16_needs_a_cpu_that_has_it(monkeypatch):
    monkeypatch.setattr(cpu_features, "has_native_bfloat16", lambda: False)
    with pytest.raises(ValueError, match="no native bfloat16"):
        resolve_backend(_args("--dtype", "bfloat16"), cuda_available=False)
    assert resolve_backend(_args("--dtype", "bfloat16"), cuda_available=True) == ("cuda",
                                                                                 "torch")
    monkeypatch.setattr(cpu_features, "has_native_bfloat16", lambda: True)
    assert resolve_backend(_args("--dtype", "bfloat16"), cuda_available=False) == ("cpu",
                                                                                  "torch")


def test_onnxruntime_backend_refuses_torch_dtypes_and_cuda():
    with pytest.raises(ValueError, match="computes in float32"):
        resolve_backend(_args("--backend", "onnxruntime", "--dtype", "float16"),
                        cuda_available=False)
    with pytest.raises(ValueError, match="runs on the CPU"):
        resolve_backend(_args("--backend", "onnxruntime"), cuda_available=True)


def test_cpu_summary_names_the_cpu_and_its_flags():
    summary = cpu_features.cpu_summary()
    assert summary["model"] and summary["cores"] >= 1
    assert set(summary["flags"]) <= set(cpu_features.NOTABLE_FLAGS)
    assert set(summary["flags"]) == set(cpu_features.NOTABLE_FLAGS) & cpu_features.cpu_flags()
    assert cpu_features.has_native_bfloat16() == bool(
        {"avx512_bf16", "amx_bf16"} & cpu_features.cpu_flags())
    assert str(summary["model"]) in cpu_features.cpu_label()
