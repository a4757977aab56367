"""Every `tests/...` path that the README, the docs, the benchmarks and the code name exists:
a test file that moves takes its mentions with it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MENTION = re.compile(r"(?<![\w/.])tests/[\w./-]*\w")
BARE = re.compile(r"(?<![\w/])test_\w+\.py")  # a test file named without its folder
SOURCES = ("*.md", "docs/**/*.md", "bus/**/*.py", "services/**/*.py", "services/**/*.cpp",
           "services/**/*.h", "bench/**/*.py", "bench/**/*.sh", "tests/**/*.py", "*.yaml",
           "pyproject.toml", "dev", ".ci/run")


def mentions(pattern: re.Pattern[str] = MENTION) -> dict[str, list[str]]:
    """Path (or bare file name) mentioned -> where (file:line)."""
    found: dict[str, list[str]] = {}
    for glob in SOURCES:
        for path in ROOT.glob(glob):
            if ".venv" in path.parts or not path.is_file():
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for match in pattern.finditer(line):
                    where = f"{path.relative_to(ROOT)}:{number}"
                    found.setdefault(match.group().rstrip("."), []).append(where)
    return found


def test_every_tests_path_mentioned_exists():
    missing = {path: where for path, where in mentions().items()
               if not ROOT.joinpath(path).exists()}
    assert missing == {}


def test_every_test_file_named_alone_exists_somewhere_in_tests():
    names = {path.name for path in ROOT.joinpath("tests").rglob("test_*.py")}
    missing = {name: where for name, where in mentions(BARE).items() if name not in names}
    assert missing == {}


def test_the_check_sees_mentions():
    """So the test above can fail: it finds this file's own mention of itself."""
    assert "tests/project/test_doc_paths.py" in mentions()
    assert "test_doc_paths.py" in mentions(BARE)
