"""Markdown tables of a `bench compare` summary (pure; re-render a saved run with
`python -m llmbus.bench.tables bench/results/<time>/summary.json`).

Ratios are peer / llmbus: above 1 means the peer has more throughput, or a longer TTFT/ITL.
The HF baseline is a static batch, so its TTFT is the prefill of the whole batch and its ITL the
mean decode step: the closest analogues, not the same measurement.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(peer: float | None, ours: float | None) -> str:
    if peer is None or not ours:
        return "-"
    return f"{peer / ours:.2f}×"


def workload_rows(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """{workload: {server: {tput, ttft, itl, tpot, failed, itl99, itl999, gap}}}, the HF
    baseline mapped in (it has no tail: one static batch)."""
    rows: dict[str, dict[str, dict[str, float | None]]] = {}
    for workload in summary["workloads"]:
        row = rows.setdefault(workload["name"], {})
        for name, record in summary["servers"].items():
            if name == "llmbus-inprocess":
                run = _inprocess_run(record, workload)
                if run is not None:
                    row[name] = {"tput": run["output_throughput"], "ttft": run["ttft_ms_p50"],
                                 "itl": run["tpot_ms_p50"], "tpot": run["tpot_ms_p50"],
                                 "failed": 0}
                continue
            if name == "hf":
                runs = [r for r in record["runs"] if workload["dataset"] == "random"
                        and r["batch_size"] == workload["concurrency"]
                        and r["input_len"] == workload["input_len"]]
                if runs:
                    row[name] = {"tput": runs[0]["output_throughput"],
                                 "ttft": runs[0]["prefill_ms"], "itl": runs[0]["decode_step_ms"],
                                 "tpot": runs[0]["decode_step_ms"], "failed": 0}
                continue
            report = record["workloads"].get(workload["name"])
            if report:
                itl = report["itl_ms"]
                row[name] = {"tput": report["output_throughput"],
                             "ttft": report["ttft_ms"]["p50"], "itl": itl["p50"],
                             "tpot": report["tpot_ms"]["p50"], "failed": report["failed"],
                             "itl99": itl.get("p99"), "itl999": itl.get("p99.9"),
                             "gap": itl.get("max")}
    return rows


def _inprocess_run(record: dict[str, Any], workload: dict[str, Any]) -> dict[str, Any] | None:
    """The in-process executor's run of this workload: one per random workload, or (a summary
    from before 2026-12-03) one at concurrency 1."""
    if "workloads" in record:
        return record["workloads"].get(workload["name"])
    if workload["concurrency"] == 1 and workload["dataset"] == "random":
        return record
    return None


def share_table(summary: dict[str, Any]) -> str:
    """What the stack leaves of the executor: served output tok/s over the in-process
    executor's on the same workload (its waves in lockstep, every step full)."""
    lines = ["| workload | llmbus tok/s | executor alone tok/s | the stack's share |",
             "|---|---:|---:|---:|"]
    for workload, servers in workload_rows(summary).items():
        served, alone = servers.get("llmbus"), servers.get("llmbus-inprocess")
        if served and alone:
            lines.append(f"| {workload} | {_num(served['tput'])} | {_num(alone['tput'])} | "
                         f"{_ratio(served['tput'], alone['tput'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def absolute_table(summary: dict[str, Any]) -> str:
    lines = ["| workload | server | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms "
             "| ITL p99.9 ms | longest gap ms | TPOT p50 ms | failed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for workload, servers in workload_rows(summary).items():
        for name, m in servers.items():
            lines.append(f"| {workload} | {name} | {_num(m['tput'])} | {_num(m['ttft'])} | "
                         f"{_num(m['itl'])} | {_num(m.get('itl99'))} | "
                         f"{_num(m.get('itl999'))} | {_num(m.get('gap'))} | "
                         f"{_num(m['tpot'])} | {m['failed']} |")
    return "\n".join(lines)


def ratio_table(summary: dict[str, Any]) -> str:
    lines = ["| workload | peer | throughput peer/llmbus | TTFT p50 peer/llmbus | "
             "ITL p50 peer/llmbus | ITL p99 peer/llmbus |", "|---|---|---:|---:|---:|---:|"]
    for workload, servers in workload_rows(summary).items():
        ours = servers.get("llmbus")
        if ours is None:
            continue
        for name, m in servers.items():
            if name != "llmbus":
                lines.append(f"| {workload} | {name} | {_ratio(m['tput'], ours['tput'])} | "
                             f"{_ratio(m['ttft'], ours['ttft'])} | "
                             f"{_ratio(m['itl'], ours['itl'])} | "
                             f"{_ratio(m.get('itl99'), ours.get('itl99'))} |")
    return "\n".join(lines)


def server_table(summary: dict[str, Any]) -> str:
    lines = ["| server | version | threads | weights | ready s | peak RSS MiB | peak PSS MiB "
             "| load avg before/after |", "|---|---|---:|---|---:|---:|---:|---|"]
    for name, record in summary["servers"].items():
        if name == "hf":
            version = f"transformers {record['transformers']}, torch {record['torch']}"
            ready, dtype = record.get("load_s"), record.get("dtype")
        else:
            version, ready, dtype = record.get("version"), record.get("ready_s"), record["dtype"]
        lines.append(f"| {name} | {version} | {record.get('threads')} | {dtype} | "
                     f"{_num(ready)} | {_num(record.get('peak_rss_mib'), 0)} | "
                     f"{_num(record.get('peak_pss_mib'), 0)} | "
                     f"{_num(record.get('load_before'))} / {_num(record.get('load_after'))} |")
    return "\n".join(lines)


def cpu_line(summary: dict[str, Any]) -> str:
    cpu = summary.get("cpu")
    if not cpu:
        return "CPU: not recorded"
    return f"CPU: {cpu['model']}, {cpu['cores']} cores; flags: {', '.join(cpu['flags'])}"


def render_all(summary: dict[str, Any], _workload_names: list[str] | None = None) -> str:
    parts = [cpu_line(summary), "", "## Ratios (peer / llmbus)", "", ratio_table(summary), "",
             "## Absolute numbers", "", absolute_table(summary), ""]
    if share := share_table(summary):
        parts += ["## The stack's share (llmbus / the executor alone)", "", share, ""]
    parts += ["## Servers", "", server_table(summary)]
    for name, why in summary.get("skipped", {}).items():
        parts.append(f"\nskipped {name}: {why.splitlines()[0] if why else ''}")
    return "\n".join(parts)


if __name__ == "__main__":
    with open(sys.argv[1]) as summary_file:
        print(render_all(json.load(summary_file)))
