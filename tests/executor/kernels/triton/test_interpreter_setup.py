"""The conftest's interpreter switch stays inside this process."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from tests.executor.kernels.triton.helpers import ON_GPU  # noqa: E402


def test_kernels_compile_on_cuda_and_interpret_elsewhere():
    assert bool(triton.knobs.runtime.interpret) == (not ON_GPU
                                                    or os.environ.get("TRITON_INTERPRET") == "1")


def test_interpreter_is_pinned_not_exported():
    """Subprocesses (the launcher, end-to-end stacks) must not inherit TRITON_INTERPRET."""
    if "interpret" not in vars(triton.knobs.runtime):
        pytest.skip("the interpreter was not switched on by the conftest")
    assert "TRITON_INTERPRET" not in os.environ
