"""Kernel tests run compiled on CUDA when there is a GPU, else under Triton's CPU interpreter.

The interpreter must be on before any `@triton.jit` decorator runs, so it is switched on here,
at collection, before a kernel module is imported. It is pinned in triton's knob and the
environment variable is put back at once, so subprocesses started by other test modules (the
launcher, end-to-end) never inherit TRITON_INTERPRET. Without triton nothing happens, and the
kernel test modules skip themselves.
"""

from __future__ import annotations

import os


def _interpret_without_cuda() -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET"):
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        triton.knobs.runtime.interpret = True  # pinned: no longer read from the environment
    except ImportError:
        pass
    finally:
        os.environ.pop("TRITON_INTERPRET", None)


_interpret_without_cuda()
