"""A minimal Prometheus registry and text exposition (format 0.0.4), with no dependency.

Only what the api needs: counters, gauges and histograms with labels, and sample lines that
other processes rendered (api copies sharing a port, see services/api/metrics.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + pairs + "}"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.documentation}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.values: dict[tuple[str, ...], float] = defaultdict(float)

    def header(self) -> list[str]:
        # The samples are `name_total`; HELP and TYPE must name what is exposed.
        return [f"# HELP {self.name}_total {self.documentation}",
                f"# TYPE {self.name}_total {self.kind}"]

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] += amount

    def samples(self) -> list[str]:
        return [f"{self.name}_total{_labels(self.labelnames, k)} {_number(v)}"
                for k, v in sorted(self.values.items())]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, *labels: str, value: float) -> None:
        self.values[labels] = value

    def samples(self) -> list[str]:
        return [f"{self.name}{_labels(self.labelnames, k)} {_number(v)}"
                for k, v in sorted(self.values.items())]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, labelnames)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = defaultdict(float)

    def observe(self, *labels: str, value: float) -> None:
        counts = self.counts.setdefault(labels, [0] * len(self.buckets))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        self.sums[labels] += value

    def count(self, *labels: str) -> int:
        return self.counts.get(labels, [0])[-1]

    def samples(self) -> list[str]:
        lines = []
        for key, counts in sorted(self.counts.items()):
            for bound, count in zip(self.buckets, counts, strict=True):
                lines.append(f"{self.name}_bucket"
                             f"{_labels((*self.labelnames, 'le'), (*key, _number(bound)))} "
                             f"{count}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} "
                         f"{_number(self.sums[key])}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {counts[-1]}")
        return lines


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: _Metric):
        self.metrics.append(metric)
        return metric

    def render(self, samples: dict[str, list[str]] | None = None) -> str:
        """The exposition; `samples` replaces the sample lines of the metrics it names (those
        gathered from several processes)."""
        samples = samples or {}
        lines = []
        for m in self.metrics:
            lines += m.header() + samples.get(m.name, m.samples())
        return "\n".join(lines) + "\n"
