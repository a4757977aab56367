"""The api's Prometheus metrics: per-request latencies seen at the edge, engine gauges and
counters fetched over the bus at scrape time.

Names mirror vLLM's (`vllm:x` is `llmbus:x` here, same suffixes, same units) so dashboards
made for vLLM adapt by changing the prefix; docs/metrics.md lists the mapping. Every series
has a `replica` label: the api copy for request metrics, the engine for engine metrics.

Api copies sharing one port (`llmbus up --replicas api=N`) each count their own requests; the
copy a scrape reaches gathers every copy's request metrics over the bus (`snapshot`), so any
scrape shows all of them.
"""

from __future__ import annotations

from bus.messages import ApiMetricsSnapshot, EngineStats
from services.api.prometheus import Counter, Gauge, Histogram, Registry

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
R = ("model_name", "replica")


class ApiMetrics:
    def __init__(self, model_name: str, replica: str) -> None:
        self.labels = (model_name, replica)
        reg = self.registry = Registry()
        self.ttft = reg.add(Histogram("llmbus:time_to_first_token_seconds",
                                      "Time from request arrival to its first token.", R,
                                      buckets=_LATENCY))
        self.itl = reg.add(Histogram("llmbus:inter_token_latency_seconds",
                                     "Time between consecutive text deltas of a choice.", R,
                                     buckets=_LATENCY))
        self.e2e = reg.add(Histogram("llmbus:e2e_request_latency_seconds",
                                     "Time from request arrival to its last token.", R,
                                     buckets=_LATENCY))
        self.queue = reg.add(Histogram("llmbus:request_queue_time_seconds",
                                       "Time a request waited before its first engine step.", R,
                                       buckets=_LATENCY))
        self.prompt_len = reg.add(Histogram("llmbus:request_prompt_tokens",
                                            "Prompt tokens per request.", R, buckets=_TOKENS))
        self.output_len = reg.add(Histogram("llmbus:request_generation_tokens",
                                            "Generated tokens per request.", R,
                                            buckets=_TOKENS))
        self.prompt_tokens = reg.add(Counter("llmbus:prompt_tokens",
                                             "Prompt tokens of finished requests.", R))
        self.generation_tokens = reg.add(Counter("llmbus:generation_tokens",
                                                 "Generated tokens of finished requests.", R))
        self.finished = reg.add(Counter("llmbus:request_success",
                                        "Finished completions by finish reason.",
                                        (*R, "finished_reason")))
        self.running = reg.add(Gauge("llmbus:num_requests_running",
                                     "Requests in the engine's running batch.", R))
        self.waiting = reg.add(Gauge("llmbus:num_requests_waiting",
                                     "Requests waiting for the engine.", R))
        self.kv_usage = reg.add(Gauge("llmbus:kv_cache_usage_perc",
                                      "Fraction of KV blocks held by requests (0-1); blocks "
                                      "only cached for reuse count as free.", R))
        self.prefix_queries = reg.add(Gauge("llmbus:prefix_cache_queries_total",
                                            "Prompt tokens looked up in the prefix cache "
                                            "(a counter, as reported by the engine).", R))
        self.prefix_hits = reg.add(Gauge("llmbus:prefix_cache_hits_total",
                                         "Prompt tokens found in the prefix cache "
                                         "(a counter, as reported by the engine).", R))
        self.preemptions = reg.add(Gauge("llmbus:num_preemptions_total",
                                         "Requests preempted to free KV blocks "
                                         "(a counter, as reported by the engine).", R))
        for metric in (self.prefix_queries, self.prefix_hits, self.preemptions):
            metric.kind = "counter"

    def observe_request(self, *, ttft: float | None, itls: list[float], e2e: float,
                        queue: float, num_prompt_tokens: int, num_output_tokens: int,
                        finish_reasons: list[str]) -> None:
        labels = self.labels
        if ttft is not None:
            self.ttft.observe(*labels, value=ttft)
        for gap in itls:
            self.itl.observe(*labels, value=gap)
        self.e2e.observe(*labels, value=e2e)
        self.queue.observe(*labels, value=queue)
        self.prompt_len.observe(*labels, value=num_prompt_tokens)
        self.output_len.observe(*labels, value=num_output_tokens)
        self.prompt_tokens.inc(*labels, amount=num_prompt_tokens)
        self.generation_tokens.inc(*labels, amount=num_output_tokens)
        self.count_finished(finish_reasons)

    def count_finished(self, finish_reasons: list[str]) -> None:
        """Each choice by how it ended. A request cut short (client gone, pipeline error)
        counts only here, its unfinished choices as `abort` (as vLLM's counter does): its
        latencies would mix partial requests into the histograms."""
        for reason in finish_reasons:
            self.finished.inc(*self.labels, reason)

    def request_metrics(self):
        return (self.ttft, self.itl, self.e2e, self.queue, self.prompt_len, self.output_len,
                self.prompt_tokens, self.generation_tokens, self.finished)

    def snapshot(self) -> ApiMetricsSnapshot:
        """This copy's request metrics, for the copy a scrape reached."""
        return ApiMetricsSnapshot(replica=self.labels[1], samples={
            m.name: m.samples() for m in self.request_metrics()})

    def set_engine_stats(self, stats: list[EngineStats]) -> None:
        for gauge in (self.running, self.waiting, self.kv_usage, self.prefix_queries,
                      self.prefix_hits, self.preemptions):
            gauge.values.clear()
        for s in stats:
            labels = (self.labels[0], s.engine_id)
            self.running.set(*labels, value=s.num_running)
            self.waiting.set(*labels, value=s.num_waiting)
            used = s.num_total_blocks - s.num_free_blocks - s.num_evictable_blocks
            self.kv_usage.set(*labels, value=used / max(s.num_total_blocks, 1))
            self.prefix_queries.set(*labels, value=s.num_prefix_query_tokens)
            self.prefix_hits.set(*labels, value=s.num_prefix_hit_tokens)
            self.preemptions.set(*labels, value=s.num_preemptions)

    def render(self, copies: list[ApiMetricsSnapshot] | None = None) -> str:
        """The exposition: request metrics of every copy in `copies` (default: this one's
        only), engine metrics as last set."""
        if copies is None:
            return self.registry.render()
        gathered = {m.name: [line for c in copies for line in c.samples.get(m.name, [])]
                    for m in self.request_metrics()}
        return self.registry.render(gathered)
