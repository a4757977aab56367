"""The api's Prometheus metrics (prometheus-client): per-request latencies seen at the edge, and
engine gauges and counters fetched over the bus at scrape time.

Names mirror vLLM's (`vllm:x` is `llmbus:x` here, same suffixes, same units) so dashboards
made for vLLM adapt by changing the prefix; docs/metrics.md lists the mapping. Every series
has a `replica` label: the api copy for request metrics, the engine for engine metrics.

Api copies sharing one port (`llmbus up --replicas api=N`) each count their own requests in a
registry of their own; the copy a scrape reaches gathers every copy's exposition over the bus
(`snapshot`) and serves them together, with the engines' stats, through collectors of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from llmbus.bus.messages import ApiMetricsSnapshot, EngineStats
from llmbus.services.api.pipeline import RecentRequests

disable_created_metrics()  # no `_created` series: vLLM's dashboards do not read them

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# Inter-token gaps: fine from 5 ms to 1 s, where a stream's cadence and its freezes lie.
_GAPS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
         0.75, 1.0, 1.5, 2.5, 5.0, 10.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
R = ("model_name", "replica")
# Series per LoRA adapter one api copy keeps at most; adapters past it count as `other`
# (adapters come and go at run time: their names must not grow the exposition without end).
MAX_ADAPTER_SERIES = 64
OTHER_ADAPTERS = "other"



def _kv_cache_usage(s: EngineStats) -> float:
    used = s.num_total_blocks - s.num_free_blocks - s.num_evictable_blocks
    return used / max(s.num_total_blocks, 1)


# What each engine reports, per engine: (kind, name, documentation, value of its EngineStats).
ENGINE_METRICS: tuple[tuple[str, str, str, Callable[[EngineStats], float]], ...] = (
    ("gauge", "llmbus:num_requests_running", "Requests in the engine's running batch.",
     lambda s: s.num_running),
    ("gauge", "llmbus:num_requests_waiting", "Requests waiting for the engine.",
     lambda s: s.num_waiting),
    ("gauge", "llmbus:kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1); "
     "blocks only cached for reuse count as free.", _kv_cache_usage),
    ("counter", "llmbus:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.num_prefix_query_tokens),
    ("counter", "llmbus:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     lambda s: s.num_prefix_hit_tokens),
    ("counter", "llmbus:num_preemptions", "Requests preempted to free KV blocks.",
     lambda s: s.num_preemptions),
    ("counter", "llmbus:spec_decode_num_draft_tokens",
     "Speculative decoding: draft tokens the model verified.", lambda s: s.num_draft_tokens),
    ("counter", "llmbus:spec_decode_num_accepted_tokens",
     "Speculative decoding: draft tokens the model agreed with.",
     lambda s: s.num_accepted_tokens),
    ("gauge", "llmbus:spec_decode_draft_acceptance_rate", "Accepted over verified draft "
     "tokens since the engine started (0 before any draft).",
     lambda s: s.num_accepted_tokens / max(s.num_draft_tokens, 1)),
    ("counter", "llmbus:remote_prefills", "Disaggregation: prompts a decode engine sent to a "
     "prefill engine.", lambda s: s.num_remote_prefills),
    ("counter", "llmbus:remote_prefill_fallbacks", "Disaggregation: ... of which the decode "
     "engine prefilled itself after all (the prefill engine refused, failed or went silent).",
     lambda s: s.num_remote_fallbacks),
    ("counter", "llmbus:kv_transfer_bytes", "Disaggregation: KV bytes a decode engine "
     "received.", lambda s: s.kv_bytes_received),
    ("counter", "llmbus:kv_transfer_seconds", "Disaggregation: seconds its KV chunks were in "
     "flight (mostly while later chunks computed).", lambda s: s.kv_transfer_seconds),
    ("counter", "llmbus:kv_transfer_wait_seconds", "Disaggregation: seconds from a prefill's "
     "last forward to its last KV chunk acknowledged (what the transfer adds to the time to "
     "first token), summed.", lambda s: s.kv_wait_seconds),
    ("counter", "llmbus:kv_handoff_seconds", "Disaggregation: seconds from the prefill "
     "engine's first token to the decode engine sending it on, summed over requests.",
     lambda s: s.handoff_seconds),
    ("counter", "llmbus:prefilled_for_others", "Disaggregation: prompts a prefill engine "
     "prefilled for decode engines.", lambda s: s.num_prefilled_for_others),
)

class _Families(Collector):
    """A collector that serves metric families made elsewhere (gathered, or built per scrape)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


class ApiMetrics:
    def __init__(self, model_name: str, replica: str) -> None:
        self.labels = (model_name, replica)
        reg = self.registry = CollectorRegistry(auto_describe=False)

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, documentation, R, buckets=buckets, registry=reg)

        self.ttft = histogram("llmbus:time_to_first_token_seconds",
                              "Time from request arrival to its first token.", _LATENCY)
        self.itl = histogram("llmbus:inter_token_latency_seconds",
                             "Time between consecutive output tokens of a choice (a delta "
                             "of n tokens: its gap over n).", _GAPS)
        self.e2e = histogram("llmbus:e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", _LATENCY)
        self.queue = histogram("llmbus:request_queue_time_seconds",
                               "Time a request waited before its first engine step.", _LATENCY)
        self.prompt_len = histogram("llmbus:request_prompt_tokens",
                                    "Prompt tokens per request.", _TOKENS)
        self.output_len = histogram("llmbus:request_generation_tokens",
                                    "Generated tokens per request.", _TOKENS)
        self.prompt_tokens = Counter("llmbus:prompt_tokens",
                                     "Prompt tokens of finished requests.", R, registry=reg)
        self.generation_tokens = Counter("llmbus:generation_tokens",
                                         "Generated tokens of finished requests.", R,
                                         registry=reg)
        self.finished = Counter("llmbus:request_success",
                                "Finished completions by finish reason.",
                                (*R, "finished_reason"), registry=reg)
        self.migrations = Counter("llmbus:request_migrations",
                                  "Requests resumed on an engine mid-stream (one per move).", R,
                                  registry=reg)
        self.embedding_requests = Counter("llmbus:embedding_requests",
                                          "Embedding (and score) requests served.", R,
                                          registry=reg)
        self.embedding_inputs = Counter("llmbus:embedding_inputs",
                                        "Inputs embedded (a request may carry many).", R,
                                        registry=reg)
        self.embedding_prompt_tokens = Counter("llmbus:embedding_prompt_tokens",
                                               "Prompt tokens of embedded inputs.", R,
                                               registry=reg)
        self.embedding_latency = histogram("llmbus:embedding_request_latency_seconds",
                                           "Time from an embedding request's arrival to its "
                                           "vectors.", _LATENCY)
        adapter_labels = (*R, "lora_name")
        self.adapter_requests = Counter(
            "llmbus:lora_requests", "Requests a LoRA adapter generated for, however they "
            "ended.", adapter_labels, registry=reg)
        self.adapter_prompt_tokens = Counter(
            "llmbus:lora_prompt_tokens", "Prompt tokens of a LoRA adapter's requests.",
            adapter_labels, registry=reg)
        self.adapter_generation_tokens = Counter(
            "llmbus:lora_generation_tokens", "Tokens a LoRA adapter generated.",
            adapter_labels, registry=reg)
        self._adapter_series: set[str] = set()
        self.engine_stats: list[EngineStats] = []
        self.recent = RecentRequests(replica)  # for the pipeline page

    def count_model(self, model: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A request for `model` ended (finished, failed or aborted): counted by adapter where
        `model` is one (the base model's requests have the series above)."""
        if model == self.labels[0]:
            return
        adapter = model
        if adapter not in self._adapter_series:
            if len(self._adapter_series) >= MAX_ADAPTER_SERIES:
                adapter = OTHER_ADAPTERS
            self._adapter_series.add(adapter)
        labels = (*self.labels, adapter)
        self.adapter_requests.labels(*labels).inc()
        self.adapter_prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        self.adapter_generation_tokens.labels(*labels).inc(num_output_tokens)

    def forget_adapter(self, adapter: str) -> None:
        """An adapter unloaded: its series go (a scrape sees its counters end), and its room
        is free for another."""
        if adapter in self._adapter_series and adapter != OTHER_ADAPTERS:
            self._adapter_series.discard(adapter)
            for counter in (self.adapter_requests, self.adapter_prompt_tokens,
                            self.adapter_generation_tokens):
                counter.remove(*self.labels, adapter)

    def observe_embeddings(self, num_inputs: int, num_tokens: int, seconds: float) -> None:
        labels = self.labels
        self.embedding_requests.labels(*labels).inc()
        self.embedding_inputs.labels(*labels).inc(num_inputs)
        self.embedding_prompt_tokens.labels(*labels).inc(num_tokens)
        self.embedding_latency.labels(*labels).observe(seconds)

    def observe_request(self, *, ttft: float | None, itls: list[float], e2e: float,
                        queue: float, num_prompt_tokens: int, num_output_tokens: int,
                        finish_reasons: list[str]) -> None:
        labels = self.labels
        if ttft is not None:
            self.ttft.labels(*labels).observe(ttft)
        for gap in itls:
            self.itl.labels(*labels).observe(gap)
        self.e2e.labels(*labels).observe(e2e)
        self.queue.labels(*labels).observe(queue)
        self.prompt_len.labels(*labels).observe(num_prompt_tokens)
        self.output_len.labels(*labels).observe(num_output_tokens)
        self.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(num_output_tokens)
        self.count_finished(finish_reasons)

    def count_finished(self, finish_reasons: list[str]) -> None:
        """Each choice by how it ended. A request cut short (client gone, pipeline error)
        counts only here, its unfinished choices as `abort` (as vLLM's counter does): its
        latencies would mix partial requests into the histograms."""
        for reason in finish_reasons:
            self.finished.labels(*self.labels, reason).inc()

    def snapshot(self) -> ApiMetricsSnapshot:
        """This copy's request metrics and recent requests, for the copy a scrape (or the
        pipeline page's poll) reached."""
        return ApiMetricsSnapshot(replica=self.labels[1],
                                  exposition=generate_latest(self.registry).decode(),
                                  recent_requests=self.recent.snapshot(time.time()))

    def set_engine_stats(self, stats: list[EngineStats]) -> None:
        self.engine_stats = list(stats)

    def _engine_families(self) -> list[Metric]:
        """The engines' state as of the last `set_engine_stats` (a custom collector's work:
        gauges and counters the engines keep, read at scrape time)."""
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, documentation, labels=R) for kind, name, documentation, _ in ENGINE_METRICS]
        for stats in self.engine_stats:
            labels = [self.labels[0], stats.engine_id]
            for family, (*_, value) in zip(families, ENGINE_METRICS, strict=True):
                family.add_metric(labels, value(stats))
        return list(families)

    def render(self, copies: list[ApiMetricsSnapshot] | None = None) -> str:
        """The exposition: request metrics of every copy in `copies` (default: this one's
        only), engine metrics as last set."""
        expositions = ([c.exposition for c in copies] if copies is not None
                       else [generate_latest(self.registry).decode()])
        families: dict[str, Metric] = {}
        for text in expositions:  # one family per name, every copy's samples in it
            for family in text_string_to_metric_families(text):
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families([*families.values(), *self._engine_families()]))
        return generate_latest(registry).decode()
