"""Progress on long work: a redrawn bar on a terminal, a few plain lines in logs."""

from __future__ import annotations

import io

from llmbus.services import model_files


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _run(monkeypatch, tty: bool) -> str:
    stream = _Stream(tty)
    monkeypatch.setattr(model_files.sys, "stderr", stream)
    bar = model_files.ProgressBar(total=1000 * 2**10, label="extracting")
    for _ in range(1000):
        bar(2**10)
    return stream.getvalue()


def test_logs_get_a_line_every_ten_percent(monkeypatch):
    lines = _run(monkeypatch, tty=False).splitlines()
    assert len(lines) == 11 and "\r" not in "".join(lines)
    assert lines[0].startswith("extracting   0%") and lines[-1].startswith("extracting 100%")


def test_a_terminal_gets_one_bar_redrawn(monkeypatch):
    text = _run(monkeypatch, tty=True)
    assert text.count("\r") == 101 and text.endswith("\n") and text.count("\n") == 1
