"""Credentials and subject permissions for the embedded nats-server (`llmbus up`).

Each service connects as its own user with a random password and may publish and subscribe
only where the pipeline needs it, so a client without credentials cannot publish into the
pipeline, and a compromised stage cannot impersonate another. Replies to requests a service
received are allowed by `allow_responses`. Each service takes its replies on inboxes of its
own (`_INBOX_<user>.`, bus/runtime.py sets the prefix) and may subscribe to no one else's, so
no stage can read the replies another asked for (an executor's step results, say). The
`observer` user (tests, dashboards) may read heartbeats and ask for stats, on the default
`_INBOX.` prefix, which no service uses; nothing else.

Every server the project starts runs JetStream (server_config's `store_dir`): the api keeps
stored responses (the Responses API's `store: true`) in its key-value store, and only the api
may reach that bucket; LoRA adapters' bytes live in its object store, which the api (load,
list, unload) and the executors (read; store those given at their start) may reach.

Services read their credentials from LLMBUS_NATS_USER / LLMBUS_NATS_PASSWORD (not from the
command line, which `ps` shows). `llmbus up --nats-tls-cert/--nats-tls-key` adds a `tls` block,
so that the bus is encrypted too; see README.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from llmbus.bus import subjects as S

ANY = "*"  # one subject token: every engine, copy or service


def _inbox(user: str) -> str:
    return f"{S.inbox_prefix(user)}.>"


# The api's stored responses (services/api/response_store_bus.py), a JetStream key-value
# bucket: its stream's info, its creation (binding to it when it exists), reading a key
# (direct get, or the stream's message get where the bucket was made without direct gets) and
# writing or deleting a key. Keys are one token (no dots), so `*`. Nothing else of JetStream:
# no other bucket or stream, no deleting or changing the bucket, no consumers.
_RESPONSE_STORE = [
    *(S.js_stream_api(verb, S.RESPONSES_STREAM)
      for verb in ("STREAM.INFO", "STREAM.CREATE", "STREAM.MSG.GET")),
    f"{S.js_stream_api('DIRECT.GET', S.RESPONSES_STREAM)}.{S.kv_key(S.RESPONSES_BUCKET, ANY)}",
    S.kv_key(S.RESPONSES_BUCKET, ANY)]

# LoRA adapters (services/adapter_store_bus.py), a JetStream object store, as nats-py 2.16 uses
# it (seen by recording its publishes): opening it is the stream's creation (a no-op where it
# exists) or its info; every call first reads an object's metadata (the stream's message get);
# reading an object's chunks (get) or every object's metadata (list) goes through an ephemeral
# ordered push consumer, whose stream nats-py looks up by subject (the stream names request),
# which delivers on this user's own inbox (its flow-control replies answer messages the server
# sent, which `allow_responses` permits: measured, a 200 MB read runs as fast without a grant
# of `$JS.FC.>`); writing is the
# chunks ($O.<bucket>.C.<nuid>) and then the metadata ($O.<bucket>.M.<name, base64>), deleting
# a metadata marker; both purge the chunks they leave behind. Each token is one (a nuid, a
# base64 name: no dots), so `*`. No other stream, no deleting or changing the bucket, no
# durable consumers.
_ADAPTER_STORE = [
    *(S.js_stream_api(verb, S.ADAPTERS_STREAM)
      for verb in ("STREAM.INFO", "STREAM.CREATE", "STREAM.MSG.GET", "STREAM.PURGE",
                   "CONSUMER.CREATE")),
    f"{S.JS_API}.STREAM.NAMES", S.object_chunks(S.ADAPTERS_BUCKET, ANY),
    S.object_meta(S.ADAPTERS_BUCKET, ANY)]


# Built from bus/subjects.py (never spelled out here), so a renamed subject cannot drift.
PERMISSIONS: dict[str, dict[str, list[str]]] = {
    "api": {
        "publish": [S.TOKENIZER_GENERATE, S.TOKENIZER_ENCODE, S.TOKENIZER_DECODE,
                    S.SCHEDULER_ABORT, S.ENGINE_MODEL, S.ENGINE_STATS, S.ping(ANY),
                    S.heartbeat("api"), S.API_METRICS, S.EXECUTOR_ADAPTERS, *_RESPONSE_STORE,
                    *_ADAPTER_STORE],
        "subscribe": [S.api_deltas(ANY), S.API_METRICS, S.heartbeat(ANY), S.ping("api"),
                      _inbox("api")],
    },
    "tokenizer": {
        "publish": [S.ENGINE_SUBMIT, S.engine_submit(ANY), S.engine_withdraw(ANY),
                    S.heartbeat("tokenizer")],
        "subscribe": [S.TOKENIZER_GENERATE, S.TOKENIZER_ENCODE, S.TOKENIZER_DECODE,
                      S.heartbeat("scheduler"), S.ENGINE_CACHE_EVENTS, S.ping("tokenizer"),
                      _inbox("tokenizer")],
    },
    "scheduler": {
        "publish": [S.executor_info(ANY), S.executor_step(ANY), S.executor_grammar(ANY),
                    S.executor_adapter(ANY),
                    S.DETOKENIZER_TOKENS, S.detokenizer_tokens(ANY), S.ENGINE_CACHE_EVENTS,
                    S.api_deltas(ANY),  # embedding answers go straight to their api copy
                    S.heartbeat("scheduler"), S.executor_kv_receive(ANY), S.engine_prefill(ANY),
                    S.engine_prefill_cancel(ANY), S.engine_prefilled(ANY)],
        "subscribe": [S.ENGINE_SUBMIT, S.engine_submit(ANY), S.engine_withdraw(ANY),
                      S.SCHEDULER_ABORT, S.ENGINE_MODEL, S.ENGINE_STATS, S.engine_stats(ANY),
                      S.heartbeat("detokenizer"), S.heartbeat("api"), S.heartbeat("executor"),
                      S.heartbeat("scheduler"), S.engine_prefill(ANY),
                      S.engine_prefill_cancel(ANY), S.engine_prefilled(ANY),
                      S.engine_unknown_completion(ANY), S.executor_progress(ANY),
                      S.ping("scheduler"), _inbox("scheduler")],
    },
    "executor": {
        "publish": [S.heartbeat("executor"), S.executor_kv(ANY), S.executor_shard(ANY, ANY, ANY),
                    S.executor_progress(ANY),
                    *_ADAPTER_STORE],
        "subscribe": [S.executor_info(ANY), S.executor_step(ANY), S.executor_grammar(ANY),
                      S.EXECUTOR_ADAPTERS, S.executor_adapter(ANY),
                      S.executor_shard(ANY, ANY, ANY), S.heartbeat("executor"),
                      S.executor_kv_receive(ANY), S.executor_kv(ANY), S.ping("executor"),
                      _inbox("executor")],
    },
    "detokenizer": {
        "publish": [S.api_deltas(ANY), S.SCHEDULER_ABORT, S.engine_unknown_completion(ANY),
                    S.heartbeat("detokenizer")],
        "subscribe": [S.DETOKENIZER_TOKENS, S.detokenizer_tokens(ANY), S.ping("detokenizer")],
    },
    "observer": {
        "publish": [S.ENGINE_STATS, S.engine_stats(ANY), S.ping(ANY)],
        "subscribe": [S.heartbeat(ANY), "_INBOX.>"],
    },
}


def new_password() -> str:
    """192 random bits, as a letter then hex digits: deploy/nats.conf takes passwords from the
    environment unquoted, where NATS would read `-…` or digits alone as a number."""
    return "p" + secrets.token_hex(24)


def generate_passwords() -> dict[str, str]:
    return {user: new_password() for user in PERMISSIONS}


def password_variable(user: str) -> str:
    """Where the compose stack keeps a bus user's password: an environment variable."""
    return f"LLMBUS_NATS_PASSWORD_{user.upper()}"


# compose.cluster.yaml's servers, nats0, nats1, ...: their ports, and the variables holding the
# route user's password and each route's URL. NATS resolves `$NAME` only as a whole value, never
# inside a string, so a route's URL (password in) is a variable of its own, which compose builds.
COMPOSE_CLIENT_PORT, COMPOSE_ROUTE_PORT = 4222, 6222
ROUTE_PASSWORD_VARIABLE = "LLMBUS_NATS_ROUTE_PASSWORD"


def route_variable(host: str) -> str:
    """Where compose.cluster.yaml keeps the URL of the route to server `host`, password in."""
    return f"LLMBUS_NATS_ROUTE_{host.upper()}"


def _marker(variable: str) -> str:
    return f"@{variable}@"


def _compose_config(cluster: ClusterRoutes | None = None,
                    variables: dict[str, str] | None = None) -> str:
    """server_config() with the secrets left to the environment: each user's password is
    $LLMBUS_NATS_PASSWORD_<USER> (NATS configuration resolves `$NAME` from the environment), and
    each other string value in `variables` becomes the variable it names."""
    passwords = {user: _marker(password_variable(user)) for user in PERMISSIONS}
    text = server_config("0.0.0.0", COMPOSE_CLIENT_PORT, passwords, cluster=cluster,
                         store_dir=COMPOSE_STORE_DIR)
    names = {marker: password_variable(user) for user, marker in passwords.items()}
    for value, variable in (names | (variables or {})).items():
        assert json.dumps(value) in text, value  # else a secret would stay a placeholder
        text = text.replace(json.dumps(value), "$" + variable)
    return text


def compose_server_config() -> str:
    """deploy/nats.conf, the compose stack's nats-server configuration: the same users and
    permissions as `llmbus up`'s, each password read from $LLMBUS_NATS_PASSWORD_<USER>."""
    return ("# The compose stack's nats-server configuration (compose.yaml). Generated from\n"
            "# services/nats_auth.py by `python -m llmbus.services.nats_auth`; a test keeps it\n"
            "# current.\n"
            + _compose_config())


def compose_cluster_config(index: int, size: int = 3) -> str:
    """deploy/nats-cluster-<index>.conf, server `nats<index>` of compose.cluster.yaml's cluster
    of `size`: deploy/nats.conf's users, and routes to the other servers as the `route` user,
    whose password is $LLMBUS_NATS_ROUTE_PASSWORD; the route to `nats<j>` is read whole from
    $LLMBUS_NATS_ROUTE_NATS<j>, which must be `route_url("nats<j>:6222", that password)`."""
    if not 0 <= index < size:
        raise ValueError(f"no server {index} in a cluster of {size}")
    others = [f"nats{i}" for i in range(size) if i != index]
    password = _marker(ROUTE_PASSWORD_VARIABLE)
    cluster = ClusterRoutes(f"nats{index}", COMPOSE_ROUTE_PORT,
                            [f"{host}:{COMPOSE_ROUTE_PORT}" for host in others], password)
    variables = {password: ROUTE_PASSWORD_VARIABLE} | {
        route_url(f"{host}:{COMPOSE_ROUTE_PORT}", password): route_variable(host)
        for host in others}
    return (f"# Server nats{index} of compose.cluster.yaml's NATS cluster; the routes' URLs come\n"
            "# from the environment. Generated from services/nats_auth.py by\n"
            f"# `python -m llmbus.services.nats_auth cluster {index}`; a test keeps it current.\n"
            + _compose_config(cluster, variables))


def compose_env() -> str:
    """A .env file for compose.yaml and compose.cluster.yaml: a random password for every bus
    user and for the cluster's route user, and an API key."""
    lines = [f"{password_variable(user)}={password}"
             for user, password in generate_passwords().items()]
    return "\n".join([*lines, f"{ROUTE_PASSWORD_VARIABLE}={new_password()}",
                      f"LLMBUS_API_KEY={secrets.token_urlsafe(32)}"]) + "\n"


@dataclass(frozen=True)
class ClusterRoutes:
    """One server's part in a NATS cluster: where it listens for the other servers, where they
    are, and the password of the route user they share (servers authenticate each other)."""

    server_name: str  # unique in the cluster
    port: int  # this server's route port
    routes: list[str]  # the other servers, as host:port of their route ports
    password: str
    name: str = "llmbus"


# What JetStream may take on each server. Two file-stored buckets use it, the api's stored
# responses (--responses-max-bytes, 1 GiB by default) and the LoRA adapters
# (--adapters-max-bytes, 4 GiB by default), which the server reserves in full when each is
# made: room for both, and little memory (nothing asks for memory storage).
JETSTREAM_MAX_FILE_STORE = 8 * 2**30
JETSTREAM_MAX_MEMORY_STORE = 64 * 2**20
COMPOSE_STORE_DIR = "/data/jetstream"  # a volume of each nats container (compose*.yaml)
# How soon a server drops a route to a peer that went silent without closing (a host cut off,
# no RST): a ping every ROUTE_PING_INTERVAL, the route closed after ROUTE_PING_MAX unanswered.
# Until it is closed the server still routes to the peer's subscribers, a queue group's
# included, so a share of the requests for a stage that moved to this server is lost there.
# The server's default (2 minutes, 2 pings) kept that up for minutes (issue 46).
ROUTE_PING_INTERVAL, ROUTE_PING_MAX = "1s", 3


def server_config(host: str, port: int, passwords: dict[str, str] | None,
                  tls: tuple[str, str] | None = None,
                  cluster: ClusterRoutes | None = None, store_dir: str | None = None) -> str:
    """A nats-server configuration (JSON is valid NATS config): with `passwords`, one user per
    service; with `tls` (certificate file, key file), TLS required of every client; with
    `cluster`, routes to the cluster's other servers. Each server tells its clients of the
    others (`connect_urls`), so a client given one server reconnects to any. With `store_dir`
    (this server's own directory), JetStream, whose servers in a cluster form one JetStream
    cluster (by their server_name): stored responses and LoRA adapters live there."""
    text = f"host: {json.dumps(host)}\nport: {port}\n"
    if store_dir is not None:
        text += "jetstream: " + json.dumps({
            "store_dir": store_dir, "max_file_store": JETSTREAM_MAX_FILE_STORE,
            "max_memory_store": JETSTREAM_MAX_MEMORY_STORE}, indent=2) + "\n"
    if cluster is not None:
        text += f"server_name: {json.dumps(cluster.server_name)}\n"
        text += "cluster: " + json.dumps({
            "name": cluster.name, "host": host, "port": cluster.port,
            "authorization": {"user": "route", "password": cluster.password},
            "ping_interval": ROUTE_PING_INTERVAL, "ping_max": ROUTE_PING_MAX,
            "routes": [route_url(route, cluster.password) for route in cluster.routes]},
            indent=2) + "\n"
    if passwords:
        users = [{"user": user, "password": passwords[user], "permissions": {
            "publish": {"allow": perms["publish"]}, "subscribe": {"allow": perms["subscribe"]},
            "allow_responses": True}} for user, perms in PERMISSIONS.items()]
        text += f"authorization: {json.dumps({'users': users}, indent=2)}\n"
    if tls:
        cert, key = tls
        text += f"tls: {json.dumps({'cert_file': cert, 'key_file': key})}\n"
    return text


def route_url(route: str, password: str) -> str:
    """How a server reaches another's route port, `host:port`: as the `route` user."""
    return f"nats-route://route:{password}@{route}"


if __name__ == "__main__":  # deploy/nats.conf; with `cluster N`, deploy/nats-cluster-N.conf
    import sys

    match sys.argv[1:]:
        case []:
            print(compose_server_config(), end="")
        case ["cluster", index]:
            print(compose_cluster_config(int(index)), end="")
        case _:
            sys.exit("usage: python -m llmbus.services.nats_auth [cluster N]")
