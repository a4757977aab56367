"""`llmbus up` as a user runs it: ready, stopped by SIGTERM, and loud when a service dies."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys

import nats
import pytest
import yaml

from llmbus.bus import subjects
from llmbus.services.cli import build_parser
from llmbus.services.launcher import (
    SERVICE_ORDER,
    free_port,
    nats_server_binary,
    parse_replicas,
    wait_for_port,
)
from llmbus.services.nats_auth import (
    COMPOSE_STORE_DIR,
    PERMISSIONS,
    compose_env,
    compose_server_config,
    password_variable,
)
from tests.stack import (
    REPO,
    processes_mentioning,
)

pytestmark = pytest.mark.adapter  # a real nats-server, no model


def test_up_says_which_service_died_and_stops_the_rest(tmp_path):
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "llmbus.services.cli", "up", "--port", str(port),
         "--model", str(tmp_path / "missing.gguf")],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert re.search(r"service `(executor|tokenizer|detokenizer)` exited with code 1",
                     result.stderr)
    assert "model file not found" in result.stderr
    assert processes_mentioning(f"--port {port}") == []


def test_compose_runs_exactly_the_launchers_services():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"nats", "jaeger", *SERVICE_ORDER}
    parser = build_parser()
    for name in SERVICE_ORDER:
        command = services[name]["command"]
        assert command[:2] == ["serve", name]
        args = parser.parse_args(command)  # every option is one the service knows
        assert args.service == name
        environment = services[name]["environment"]
        assert environment["LLMBUS_NATS_URL"] == "nats://nats:4222"
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
        # each stage is its own bus user, its password from .env
        assert environment["LLMBUS_NATS_USER"] == name
        assert environment["LLMBUS_NATS_PASSWORD"].startswith(
            "${" + password_variable(name) + ":?")


def test_compose_stack_is_locked():
    """The bus is not published on the host and runs deploy/nats.conf (current with
    services/nats_auth.py); the api needs a key; the trace viewer is this host's only."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    nats_service = compose["services"]["nats"]
    assert "ports" not in nats_service
    assert nats_service["entrypoint"] == ["nats-server", "-c", "/etc/llmbus/nats.conf"]
    assert nats_service["volumes"] == ["./deploy/nats.conf:/etc/llmbus/nats.conf:ro",
                                       f"nats-store:{COMPOSE_STORE_DIR}"]  # JetStream's
    assert "nats-store" in compose["volumes"]
    assert set(nats_service["environment"]) == {password_variable(u) for u in PERMISSIONS}
    assert (REPO / "deploy" / "nats.conf").read_text() == compose_server_config()
    assert compose["services"]["api"]["environment"]["LLMBUS_API_KEY"].startswith(
        "${LLMBUS_API_KEY:?")
    assert all(port.startswith("127.0.0.1:")
               for port in compose["services"]["jaeger"]["ports"])


def test_compose_pipeline_page_links_to_the_published_trace_viewer():
    from llmbus.services.api.service import _trace_url

    for file in ("compose.yaml", "compose.cluster.yaml"):
        compose = yaml.safe_load((REPO / file).read_text())
        url = _trace_url(compose["services"]["api"]["environment"]["LLMBUS_TRACE_URL"])
        [published] = compose["services"]["jaeger"]["ports"]  # host address:port:16686
        assert url == f"http://{published.rsplit(':', 1)[0]}/trace/{{trace_id}}", file
    with pytest.raises(argparse.ArgumentTypeError, match="trace_id"):
        _trace_url("http://127.0.0.1:16686/trace/")  # refused at start-up, by argparse


async def test_compose_bus_config_admits_only_its_users(tmp_path):
    """deploy/nats.conf on a real nats-server, passwords from a `llmbus compose-env` file.
    Every bus user gets in with its password and is held to its permissions: it cannot read
    another user's inbox (where, for the scheduler, the executor's step results arrive), nor
    publish a step plan unless it is the scheduler. A wrong password or none gets nothing."""
    env = dict(line.split("=", 1) for line in compose_env().splitlines())
    # NATS reads these unquoted: a leading "-" or digits alone would parse as a number
    assert all(re.fullmatch("p[0-9a-f]{48}", value) for name, value in env.items()
               if name.startswith("LLMBUS_NATS_PASSWORD_"))
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text((REPO / "deploy" / "nats.conf").read_text()
                      .replace('host: "0.0.0.0"', 'host: "127.0.0.1"')
                      .replace("port: 4222", f"port: {port}")
                      .replace(COMPOSE_STORE_DIR, str(tmp_path / "jetstream")))
    log = tmp_path / "nats.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([nats_server_binary(), "-c", str(config)],
                                  env=dict(os.environ, **env), stdout=out, stderr=out)
    try:
        assert wait_for_port("127.0.0.1", port, timeout=30), log.read_text()
        url = f"nats://127.0.0.1:{port}"
        for user in PERMISSIONS:
            errors = []

            async def on_error(exc: Exception, errors=errors) -> None:
                errors.append(str(exc).lower())

            client = await nats.connect(url, user=user, error_cb=on_error,
                                        password=env[password_variable(user)])
            other = "api" if user == "scheduler" else "scheduler"
            await client.subscribe(f"{subjects.inbox_prefix(other)}.x")
            if user != "scheduler":
                await client.publish(subjects.executor_step("engine0"), b"junk")
            await client.flush()
            wanted = 1 if user == "scheduler" else 2
            for _ in range(30):
                if len(errors) >= wanted:
                    break
                await asyncio.sleep(0.1)
            assert len([e for e in errors if "permissions violation" in e]) == wanted, \
                (user, errors)
            await client.close()
        for credentials in ({"user": "api", "password": "wrong"}, {}):
            with pytest.raises(Exception, match="(?i)authorization"):
                await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0,
                                   connect_timeout=2, **credentials)
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.parametrize("argv", [["--help"], ["up", "--help"], ["model", "pull", "--help"],
                                  *(["serve", name, "--help"] for name in SERVICE_ORDER)])
def test_every_command_explains_itself(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 0
    assert "--" in capsys.readouterr().out


def test_up_hands_each_service_its_own_options_and_no_defaults():
    from llmbus.services.cli import _argv_for, build_parser

    args = build_parser().parse_args(["up", "--threads", "3", "--no-prefix-caching",
                                      "--engine-id", "e9", "--port", "9000",
                                      "--api-key", "secret", "--lora", "a=/x", "--lora", "b=/y"])
    common = ["--log-format", args.log_format, "--log-level", args.log_level]
    argv = {name: _argv_for(name, args)[len(common):] for name in
            ("executor", "scheduler", "api", "tokenizer", "detokenizer")}
    assert "--threads" in argv["executor"] and argv["executor"][argv["executor"].index(
        "--threads") + 1] == "3"
    assert sorted(argv["scheduler"]) == sorted(["--engine-id", "e9", "--no-prefix-caching"])
    assert "--engine-id" in argv["executor"]
    assert argv["executor"][-4:] == ["--lora", "a=/x", "--lora", "b=/y"]  # repeated as given
    assert argv["api"] == ["--port", "9000"]  # the key travels in the environment, not argv
    assert argv["tokenizer"] == argv["detokenizer"] == []


def test_the_disaggregated_compose_file_makes_a_prefill_and_a_decode_engine():
    """compose.disaggregated.yaml over compose.yaml: the engine decodes, a prefill engine
    joins it, every command one the service knows, each as its stage's bus user."""
    base = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    extra = yaml.safe_load((REPO / "compose.disaggregated.yaml").read_text())["services"]
    services = {name: {**base.get(name, {}), **extra[name]} for name in extra}
    parser = build_parser()
    engines = {}
    for service in services.values():
        args = parser.parse_args(service["command"])
        engines.setdefault(args.engine_id, set()).add(
            (args.service, getattr(args, "role", None)))
        stage = args.service
        assert service["environment"]["LLMBUS_NATS_USER"] == stage
        assert service["environment"]["LLMBUS_NATS_PASSWORD"].startswith(
            "${" + password_variable(stage) + ":?")
        assert service["environment"]["LLMBUS_NATS_URL"] == "nats://nats:4222"
    assert engines == {"decode0": {("scheduler", "decode"), ("executor", None)},
                       "prefill0": {("scheduler", "prefill"), ("executor", None)}}


def test_the_pipeline_compose_file_splits_the_executor_in_two_shards():
    """compose.pipeline.yaml over compose.yaml: the engine's executor is shard 0 of 2, the
    other shard joins it as the executor's bus user, and `up` passes --pipeline-shards on."""
    base = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    extra = yaml.safe_load((REPO / "compose.pipeline.yaml").read_text())["services"]
    services = {name: {**base.get(name, {}), **extra[name]} for name in extra}
    parser = build_parser()
    shards = {}
    for service in services.values():
        args = parser.parse_args(service["command"])
        assert (args.service, args.engine_id) == ("executor", "engine0")
        shards[args.shard] = service
        assert service["environment"]["LLMBUS_NATS_USER"] == "executor"
    assert set(shards) == {"0/2", "1/2"}
    assert shards["1/2"]["environment"]["LLMBUS_NATS_URL"].endswith(":-nats://nats:4222}")
    up = parser.parse_args(["up", "--pipeline-shards", "3"])
    assert up.pipeline_shards == 3 and not hasattr(up, "shard")  # `up` sets --shard itself


def test_replicas_of_disaggregated_engines():
    counts = parse_replicas("prefill=1,decode=2")
    assert (counts["engine"], counts["prefill"], counts["decode"]) == (0, 1, 2)
    counts = parse_replicas("engine=1,decode=1,api=2")  # mixed and decode engines side by side
    assert (counts["engine"], counts["prefill"], counts["decode"], counts["api"]) == (1, 0, 1, 2)
    assert parse_replicas("")["engine"] == 1
    for bad, why in (("prefill=1", "need a decode engine"),
                     ("engine=0", "no engine would take requests"),
                     ("prefill=1,decode=0", "need a decode engine"),
                     ("warmup=1", "expected NAME=COUNT")):
        with pytest.raises(ValueError, match=why):
            parse_replicas(bad)
