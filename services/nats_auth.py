"""Credentials and subject permissions for the embedded nats-server (`llmbus up`).

Each service connects as its own user with a random password and may publish and subscribe
only where the pipeline needs it, so a client without credentials cannot publish into the
pipeline, and a compromised stage cannot impersonate another. Replies to requests a service
received are allowed by `allow_responses`. Each service takes its replies on inboxes of its
own (`_INBOX_<user>.`, bus/runtime.py sets the prefix) and may subscribe to no one else's, so
no stage can read the replies another asked for (an executor's step results, say). The
`observer` user (tests, dashboards) may read heartbeats and ask for stats, on the default
`_INBOX.` prefix, which no service uses; nothing else.

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


# Built from bus/subjects.py (never spelled out here), so a renamed subject cannot drift.
PERMISSIONS: dict[str, dict[str, list[str]]] = {
    "api": {
        "publish": [S.TOKENIZER_GENERATE, S.TOKENIZER_ENCODE, S.TOKENIZER_DECODE,
                    S.SCHEDULER_ABORT, S.ENGINE_MODEL, S.ENGINE_STATS, S.ping(ANY),
                    S.heartbeat("api"), S.API_METRICS],
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
                    S.DETOKENIZER_TOKENS, S.detokenizer_tokens(ANY), S.ENGINE_CACHE_EVENTS,
                    S.heartbeat("scheduler")],
        "subscribe": [S.ENGINE_SUBMIT, S.engine_submit(ANY), S.engine_withdraw(ANY),
                      S.SCHEDULER_ABORT, S.ENGINE_MODEL, S.ENGINE_STATS, S.engine_stats(ANY),
                      S.heartbeat("detokenizer"), S.heartbeat("api"), S.heartbeat("executor"),
                      S.engine_unknown_completion(ANY), S.ping("scheduler"), _inbox("scheduler")],
    },
    "executor": {
        "publish": [S.heartbeat("executor")],
        "subscribe": [S.executor_info(ANY), S.executor_step(ANY), S.executor_grammar(ANY),
                      S.ping("executor")],
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


def generate_passwords() -> dict[str, str]:
    """192 random bits each, as a letter then hex digits: deploy/nats.conf takes them from the
    environment unquoted, where NATS would read `-…` or digits alone as a number."""
    return {user: "p" + secrets.token_hex(24) for user in PERMISSIONS}


def password_variable(user: str) -> str:
    """Where the compose stack keeps a bus user's password: an environment variable."""
    return f"LLMBUS_NATS_PASSWORD_{user.upper()}"


def compose_server_config() -> str:
    """deploy/nats.conf, the compose stack's nats-server configuration: the same users and
    permissions as `llmbus up`'s, each password read from $LLMBUS_NATS_PASSWORD_<USER> (NATS
    configuration resolves `$NAME` from the environment)."""
    markers = {user: f"@{password_variable(user)}@" for user in PERMISSIONS}
    text = server_config("0.0.0.0", 4222, markers)
    for user, marker in markers.items():
        text = text.replace(json.dumps(marker), "$" + password_variable(user))
    return ("# The compose stack's nats-server configuration (compose.yaml). Generated from\n"
            "# services/nats_auth.py by `python -m llmbus.services.nats_auth`; a test keeps it\n"
            "# current.\n"
            + text)


def compose_env() -> str:
    """A .env file for compose.yaml: a random password for every bus user and an API key."""
    lines = [f"{password_variable(user)}={password}"
             for user, password in generate_passwords().items()]
    return "\n".join([*lines, f"LLMBUS_API_KEY={secrets.token_urlsafe(32)}"]) + "\n"


@dataclass(frozen=True)
class ClusterRoutes:
    """One server's part in a NATS cluster: where it listens for the other servers, where they
    are, and the password of the route user they share (servers authenticate each other)."""

    server_name: str  # unique in the cluster
    port: int  # this server's route port
    routes: list[str]  # the other servers, as host:port of their route ports
    password: str
    name: str = "llmbus"


def server_config(host: str, port: int, passwords: dict[str, str] | None,
                  tls: tuple[str, str] | None = None,
                  cluster: ClusterRoutes | None = None) -> str:
    """A nats-server configuration (JSON is valid NATS config): with `passwords`, one user per
    service; with `tls` (certificate file, key file), TLS required of every client; with
    `cluster`, routes to the cluster's other servers. Each server tells its clients of the
    others (`connect_urls`), so a client given one server reconnects to any."""
    text = f"host: {json.dumps(host)}\nport: {port}\n"
    if cluster is not None:
        auth = f"route:{cluster.password}@"
        text += f"server_name: {json.dumps(cluster.server_name)}\n"
        text += "cluster: " + json.dumps({
            "name": cluster.name, "host": host, "port": cluster.port,
            "authorization": {"user": "route", "password": cluster.password},
            "routes": [f"nats-route://{auth}{route}" for route in cluster.routes]}) + "\n"
    if passwords:
        users = [{"user": user, "password": passwords[user], "permissions": {
            "publish": {"allow": perms["publish"]}, "subscribe": {"allow": perms["subscribe"]},
            "allow_responses": True}} for user, perms in PERMISSIONS.items()]
        text += f"authorization: {json.dumps({'users': users}, indent=2)}\n"
    if tls:
        cert, key = tls
        text += f"tls: {json.dumps({'cert_file': cert, 'key_file': key})}\n"
    return text


if __name__ == "__main__":
    print(compose_server_config(), end="")
