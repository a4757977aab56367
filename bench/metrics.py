"""Per-request timings and the report built from them (pure: no I/O, no clock reads).

Definitions follow vLLM's `benchmark_serving`, so numbers are comparable with what users of
the peers already quote: TTFT is request start to first streamed text; TPOT is the rest of the
request divided by its remaining output tokens; ITL is every gap between streamed text chunks,
so its max is the longest a stream froze. p99.9 and max are the tail a stream's reader notices:
one gap in a thousand, and the worst one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99, 99.9)


@dataclass
class RequestResult:
    """What one streamed request measured; times in seconds from the request's start."""

    ok: bool = False
    prompt_len: int | None = None
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_text: str = ""
    usage_counted: bool = False  # output_tokens came from the server's `usage`
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} outside [0, 100]")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, percentiles and max in milliseconds; None (JSON null) when there was nothing to
    time."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    values = [v * 1000 for v in values_s]
    return {"mean": sum(values) / len(values),
            **{f"p{p}": percentile(values, p) for p in PERCENTILES}, "max": max(values)}


def summarize(results: Sequence[RequestResult], duration: float,
              config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of one run, as written to --result-json (every field is JSON-ready)."""
    done = [r for r in results if r.ok]
    total_output = sum(r.output_tokens for r in done)
    total_input = sum(r.prompt_len or 0 for r in done)
    sources = {"usage" if r.usage_counted else "tokenizer" for r in done}
    return {
        "config": dict(config or {}),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "output_tokens_counted_by": "+".join(sorted(sources)) or None,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration else 0.0,
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "tpot_ms": stats_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl]),
        "e2e_latency_ms": stats_ms([r.latency for r in done]),
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table printed on stdout."""
    rows = [
        ("Completed requests", report["completed"]),
        ("Failed requests", report["failed"]),
        ("Duration (s)", report["duration_s"]),
        ("Total input tokens", report["total_input_tokens"]),
        ("Total output tokens", report["total_output_tokens"]),
        ("Request throughput (req/s)", report["request_throughput"]),
        ("Output token throughput (tok/s)", report["output_throughput"]),
        ("Total token throughput (tok/s)", report["total_token_throughput"]),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2e_latency_ms", "E2E latency")):
        for stat in ("mean", *(f"p{p}" for p in PERCENTILES), "max"):
            rows.append((f"{name} {stat} (ms)", report[key][stat]))
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{'=' * 16} Serving benchmark result {'=' * 16}"]
    lines += [f"{name:<{width}}{_fmt(value):>16}" for name, value in rows]
    for error in report.get("errors", []):
        lines.append(f"error: {error}")
    return "\n".join(lines)
