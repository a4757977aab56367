"""compose.cluster.yaml, the stack on a three-server NATS cluster: its stages and servers as
the launcher's and as locked, and its generated server configs forming one cluster for real."""

from __future__ import annotations

import os
import subprocess

import nats
import pytest
import yaml

from llmbus.bus import subjects
from llmbus.services.cli import build_parser
from llmbus.services.launcher import free_port, nats_server_binary, wait_for_port
from llmbus.services.nats_auth import (
    COMPOSE_STORE_DIR,
    PERMISSIONS,
    ROUTE_PASSWORD_VARIABLE,
    compose_cluster_config,
    compose_env,
    password_variable,
    route_url,
    route_variable,
)
from tests.stack import REPO

pytestmark = pytest.mark.adapter  # a real nats-server, no model


def test_compose_cluster_spreads_the_stages_over_three_locked_servers():
    """compose.cluster.yaml: compose.yaml's stages, with two engines and two detokenizers, on
    the servers nats0..2, each running its deploy/nats-cluster-N.conf (current with
    services/nats_auth.py) with a JetStream store of its own, and none published on the host;
    every stage is given all three, and the api keeps stored responses on all three."""
    single = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    compose = yaml.safe_load((REPO / "compose.cluster.yaml").read_text())
    services = compose["services"]
    servers = [f"nats{i}" for i in range(3)]
    stages = {name: s for name, s in services.items() if name not in {*servers, "jaeger"}}
    stage_of = {name: stage["command"][1] for name, stage in stages.items()}
    assert sorted(stage_of.values()) == sorted(
        [*(set(single) - {"nats", "jaeger"}), "scheduler", "executor", "detokenizer"])
    parser = build_parser()
    engines = [(stage_of[name], parser.parse_args(stage["command"]).engine_id)
               for name, stage in stages.items() if stage_of[name] in {"scheduler", "executor"}]
    assert sorted(engines) == sorted((s, e) for s in ("scheduler", "executor")
                                     for e in ("engine1", "engine2"))
    route_password = "${" + ROUTE_PASSWORD_VARIABLE + "}"
    for i, server in enumerate(servers):
        nats_service = services[server]
        assert "ports" not in nats_service
        assert nats_service["entrypoint"] == ["nats-server", "-c", "/etc/llmbus/nats.conf"]
        assert nats_service["volumes"] == [  # its config, and its own JetStream store
            f"./deploy/nats-cluster-{i}.conf:/etc/llmbus/nats.conf:ro",
            f"{server}-store:{COMPOSE_STORE_DIR}"]
        assert f"{server}-store" in compose["volumes"]
        assert (REPO / "deploy" / f"nats-cluster-{i}.conf").read_text() == \
            compose_cluster_config(i)
        environment = nats_service["environment"]
        assert environment[ROUTE_PASSWORD_VARIABLE].startswith(
            "${" + ROUTE_PASSWORD_VARIABLE + ":?")
        assert set(environment) == {*map(password_variable, PERMISSIONS),
                                    ROUTE_PASSWORD_VARIABLE, *map(route_variable, servers)}
        for host in servers:
            assert environment[route_variable(host)] == route_url(f"{host}:6222",
                                                                  route_password)
    assert all("ports" not in stage for name, stage in stages.items() if name != "api")
    # a stored response and a LoRA adapter are kept on every server: losing one loses none
    api_args = parser.parse_args(stages["api"]["command"])
    assert (api_args.responses_replicas, api_args.adapters_replicas) == (3, 3)
    for name, stage in stages.items():
        environment = stage["environment"]
        urls = environment["LLMBUS_NATS_URL"].split(",")
        assert sorted(urls) == [f"nats://{server}:4222" for server in servers], name
        assert environment["LLMBUS_NATS_USER"] == stage_of[name]
        assert environment["LLMBUS_NATS_PASSWORD"].startswith(
            "${" + password_variable(stage_of[name]) + ":?")
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"


async def test_compose_cluster_configs_form_one_cluster(tmp_path):
    """deploy/nats-cluster-N.conf on three real nats-servers, the routes' URLs made as
    compose.cluster.yaml makes them: the servers admit each other as the route user, and what
    the api publishes on one server reaches the observer on another."""
    env = dict(line.split("=", 1) for line in compose_env().splitlines())
    ports = [(free_port(), free_port()) for _ in range(3)]  # (client, route)
    for i, (_, route_port) in enumerate(ports):
        env[route_variable(f"nats{i}")] = route_url(f"127.0.0.1:{route_port}",
                                                    env[ROUTE_PASSWORD_VARIABLE])
    servers = []
    try:
        for i, (port, route_port) in enumerate(ports):
            config = tmp_path / f"nats-{i}.conf"
            config.write_text((REPO / "deploy" / f"nats-cluster-{i}.conf").read_text()
                              .replace('"0.0.0.0"', '"127.0.0.1"')
                              .replace("port: 4222", f"port: {port}")
                              .replace('"port": 6222', f'"port": {route_port}')
                              .replace(COMPOSE_STORE_DIR, str(tmp_path / f"jetstream-{i}")))
            with open(tmp_path / f"nats-{i}.log", "wb") as out:
                servers.append(subprocess.Popen([nats_server_binary(), "-c", str(config)],
                                                env=dict(os.environ, **env),
                                                stdout=out, stderr=out))
        for i, (port, _) in enumerate(ports):
            assert wait_for_port("127.0.0.1", port, timeout=30), \
                (tmp_path / f"nats-{i}.log").read_text()
        urls = [f"nats://127.0.0.1:{port}" for port, _ in ports]
        observer = await nats.connect(urls[0], user="observer",
                                      password=env[password_variable("observer")])
        api = await nats.connect(urls[2], user="api", password=env[password_variable("api")])
        try:
            heard = await observer.subscribe(subjects.heartbeat("api"))
            await observer.flush()
            for _ in range(100):  # until the routes are up and the interest has crossed
                await api.publish(subjects.heartbeat("api"), b"hello")
                try:
                    assert (await heard.next_msg(timeout=0.2)).data == b"hello"
                    break
                except nats.errors.TimeoutError:
                    continue
            else:
                raise AssertionError((tmp_path / "nats-0.log").read_text())
        finally:
            await api.close()
            await observer.close()
    finally:
        for server in servers:
            server.terminate()
            server.wait(10)
