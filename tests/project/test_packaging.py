"""What `pip install .` puts on a machine: everything under one `llmbus` name, every package
folder of the checkout, the kernel sources the executor compiles, and a command that runs from
there (not from the checkout)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The checkout's folders and the names they are installed under (pyproject.toml's package-dir).
INSTALLED_AS = {"bus": "llmbus/bus", "services": "llmbus/services", "bench": "llmbus/bench"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy: setuptools would reuse what an earlier build left in the checkout's build/.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    for folder in INSTALLED_AS:
        shutil.copytree(REPO / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    # No build isolation: setuptools is already here (torch requires it); nothing to download.
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                    "--no-build-isolation", "--quiet", "--wheel-dir", str(out)],
                   check=True, capture_output=True, timeout=300)
    (path,) = out.glob("llmbus-*.whl")
    return path


def test_nothing_but_llmbus_is_installed_at_the_top(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"llmbus", next(t for t in tops if t.endswith(".dist-info"))}


def test_every_package_folder_and_kernel_source_is_in_the_wheel(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for folder, installed in INSTALLED_AS.items():
        for path in REPO.joinpath(folder).rglob("*"):
            relative = path.relative_to(REPO / folder).as_posix()
            wanted = (path.suffix == ".py" or path.suffix in (".cpp", ".h")
                      and "kernels" in path.parts)
            if path.is_file() and wanted and "results" not in path.parts:
                if f"{installed}/{relative}" not in names:
                    missing.append(f"{folder}/{relative}")
    assert missing == []  # a new package folder goes into pyproject.toml's `packages`


def test_the_installed_command_runs_from_the_install(wheel: Path, tmp_path: Path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                    "--target", str(target), str(wheel)], check=True, capture_output=True,
                   timeout=300)
    env = dict(os.environ, PYTHONPATH=str(target))
    where = subprocess.run(
        [sys.executable, "-c", "import llmbus.services.cli as c, llmbus.bench.cli as b; "
                               "print(c.__file__); print(b.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert all(line.startswith(str(target)) for line in where.stdout.split()), where.stdout
    for command in (["--help"], ["up", "--help"], ["serve", "executor", "--help"],
                    ["bench", "serve", "--help"]):
        result = subprocess.run([sys.executable, "-m", "llmbus.services.cli", *command],
                                cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "usage:" in result.stdout
    bare = subprocess.run([sys.executable, "-c", "import services"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "No module named 'services'" in bare.stderr
