"""The api's entry point: one NATS connection plus a uvicorn server for the litestar app."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from types import FrameType

import structlog
import uvicorn
from litestar import Litestar
from nats.aio.msg import Msg

from llmbus.bus import subjects
from llmbus.bus.messages import ApiMetricsRequest, ApiMetricsSnapshot
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.adapter_store_bus import (
    DEFAULT_MAX_BYTES,
    AdapterStore,
    AdapterStoreUnavailable,
)
from llmbus.services.api.app import ApiSettings, create_app
from llmbus.services.api.embeddings import DEFAULT_MAX_INPUTS
from llmbus.services.api.engine_client_bus import EngineClient
from llmbus.services.api.migration import DEFAULT_MIGRATION_LIMIT
from llmbus.services.api.response_store_bus import ResponseStore, ResponseStoreUnavailable
from llmbus.services.api.schemas import Limits

log = structlog.get_logger()


def _migration_limit(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _trace_url(text: str) -> str:
    if "{trace_id}" not in text:
        raise argparse.ArgumentTypeError(f"must contain {{trace_id}}, got {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=os.environ.get("LLMBUS_HOST", "127.0.0.1"),
                        help="address the HTTP server binds (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("LLMBUS_PORT", "8000")),
                        help="HTTP port (default: 8000)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds without progress after which a request ends with an "
                             "error (default: 600)")
    parser.add_argument("--migration-limit", type=_migration_limit,
                        default=DEFAULT_MIGRATION_LIMIT,
                        help="times a request may move to another engine when its engine "
                             "fails or the bus loses its messages mid-stream; it resumes from "
                             "the tokens already streamed. Past it the client gets the error "
                             f"(default: {DEFAULT_MIGRATION_LIMIT}; 0: never move)")
    parser.add_argument("--max-tokens-cap", type=int, default=8192,
                        help="largest max_tokens a client may ask for (default: 8192)")
    parser.add_argument("--max-n", type=int, default=16,
                        help="largest n (completions per prompt) a client may ask for "
                             "(default: 16)")
    parser.add_argument("--max-prompts", type=int, default=64,
                        help="most prompts one batched /v1/completions request may carry "
                             "(default: 64)")
    parser.add_argument("--max-embedding-inputs", type=int, default=DEFAULT_MAX_INPUTS,
                        help="most inputs one /v1/embeddings request may carry (default: "
                             f"{DEFAULT_MAX_INPUTS}, as OpenAI)")
    parser.add_argument("--max-body-size", type=int, default=4 * 2**20,
                        help="largest request body in bytes (default: 4 MiB)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds for open requests to finish; /health answers "
                             "503 from the start so load balancers stop sending (default: 30)")
    parser.add_argument("--trace-url", type=_trace_url,
                        default=os.environ.get("LLMBUS_TRACE_URL") or None,
                        help="a trace viewer's URL with {trace_id} in it, e.g. "
                             "http://127.0.0.1:16686/trace/{trace_id} (Jaeger): the pipeline "
                             "page links each recent request to its trace (default: "
                             "$LLMBUS_TRACE_URL; unset = no links)")
    parser.add_argument("--api-key", default=os.environ.get("LLMBUS_API_KEY"),
                        help="require `Authorization: Bearer KEY` on every /v1 route "
                             "(default: $LLMBUS_API_KEY; unset = no key)")
    parser.add_argument("--responses-ttl", type=_positive(float), default=30 * 24 * 3600.0,
                        help="seconds a stored response (Responses API, store: true) is kept "
                             "in the bus's JetStream bucket llmbus_responses (default: 2592000, "
                             "30 days, as OpenAI keeps them)")
    parser.add_argument("--responses-max-bytes", type=_positive(int), default=2**30,
                        help="most bytes the stored responses may take; past it, storing is "
                             "refused until some expire (default: 1 GiB)")
    parser.add_argument("--responses-replicas", type=_positive(int), default=1,
                        help="NATS servers that keep a copy of each stored response: 3 on a "
                             "cluster, so that losing a server loses none (default: 1)")
    parser.add_argument("--adapter-load-timeout", type=_positive(float), default=60.0,
                        help="seconds POST /v1/load_lora_adapter waits for every engine to "
                             "check and load the adapter (default: 60)")
    parser.add_argument("--adapters-max-bytes", type=_positive(int), default=DEFAULT_MAX_BYTES,
                        help="most bytes the LoRA adapters in the bus's JetStream bucket "
                             "llmbus_adapters may take; past it, loading is refused "
                             f"(default: {DEFAULT_MAX_BYTES // 2**30} GiB)")
    parser.add_argument("--adapters-replicas", type=_positive(int), default=1,
                        help="NATS servers that keep a copy of each LoRA adapter: 3 on a "
                             "cluster (default: 1)")


def _positive(kind: type) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
        return value

    return parse


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, /health turns 503 first, then uvicorn stops accepting and waits
    for open requests (up to --shutdown-timeout)."""

    def __init__(self, app: Litestar, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app.state.draining = True
        super().handle_exit(sig, frame)


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket with SO_REUSEPORT: several api copies share one port and the
    kernel spreads connections over them (how `llmbus up --replicas api=N` scales)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def answer_metrics(runtime: ServiceRuntime, app: Litestar) -> None:
    """Answer the api copies' scatter-gather for request metrics (any copy may be scraped)."""

    async def on_metrics(_: ApiMetricsRequest, __: Msg) -> ApiMetricsSnapshot:
        metrics = app.state.get("metrics")  # made on the first request or scrape
        return (metrics.snapshot() if metrics is not None
                else ApiMetricsSnapshot(replica=runtime.instance_id))

    await runtime.on_request(subjects.API_METRICS, ApiMetricsRequest, on_metrics)


async def _open_response_store(runtime: ServiceRuntime,
                               args: argparse.Namespace) -> ResponseStore | None:
    """The bus's store of responses; None, with one warning line, where it cannot be had
    (the api serves everything else, and answers `store: true` with an error)."""
    try:
        return await ResponseStore.open(runtime, ttl_s=args.responses_ttl,
                                        max_bytes=args.responses_max_bytes,
                                        replicas=args.responses_replicas)
    except ResponseStoreUnavailable as exc:
        log.warning(f"stored responses are off: {exc}")
        return None


async def _open_adapter_store(runtime: ServiceRuntime,
                              args: argparse.Namespace) -> AdapterStore | None:
    """The bus's LoRA adapters; None, with one warning line, where they cannot be had (the
    base model serves alone, and loading an adapter answers why not)."""
    try:
        return await AdapterStore.open(runtime, args.adapters_replicas,
                                       max_bytes=args.adapters_max_bytes)
    except AdapterStoreUnavailable as exc:
        log.warning(f"LoRA adapters are off: {exc}")
        return None


async def main(args: argparse.Namespace) -> None:
    # uvicorn takes SIGINT/SIGTERM itself: stops accepting, finishes streams, then returns.
    async with ServiceRuntime("api", args.nats_url, args.instance_id,
                              handle_signals=False) as runtime:
        engine = EngineClient(runtime, request_timeout=args.request_timeout,
                              migration_limit=args.migration_limit)
        await engine.start()
        settings = ApiSettings(
            limits=Limits(max_tokens=args.max_tokens_cap, max_n=args.max_n,
                          max_prompts=args.max_prompts),
            max_body_bytes=args.max_body_size, api_key=args.api_key,
            max_embedding_inputs=args.max_embedding_inputs,
            trace_url=args.trace_url, adapter_load_timeout=args.adapter_load_timeout)
        store = await _open_response_store(runtime, args)
        adapters = await _open_adapter_store(runtime, args)
        app = create_app(engine, settings, response_store=store, adapter_store=adapters)
        server = DrainingServer(app, uvicorn.Config(
            app, host=args.host, port=args.port, log_config=None, access_log=False,
            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on"))

        await answer_metrics(runtime, app)
        runtime.mark_ready()
        log.info("api listening", url=f"http://{args.host}:{args.port}")
        await server.serve(sockets=[shared_port_socket(args.host, args.port)])
