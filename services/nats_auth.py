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

from bus.subjects import inbox_prefix

P = "llmbus.v1"


def _inbox(user: str) -> str:
    return f"{inbox_prefix(user)}.>"


PERMISSIONS: dict[str, dict[str, list[str]]] = {
    "api": {
        "publish": [f"{P}.tokenizer.generate", f"{P}.tokenizer.encode", f"{P}.tokenizer.decode",
                    f"{P}.engine.abort", f"{P}.engine.model", f"{P}.engine.stats",
                    f"{P}.ping.*", f"{P}.heartbeat.api", f"{P}.api.metrics"],
        "subscribe": [f"{P}.api.*.deltas", f"{P}.api.metrics", f"{P}.heartbeat.*",
                      f"{P}.ping.api", _inbox("api")],
    },
    "tokenizer": {
        "publish": [f"{P}.engine.submit", f"{P}.engine.*.submit", f"{P}.engine.*.withdraw",
                    f"{P}.heartbeat.tokenizer"],
        "subscribe": [f"{P}.tokenizer.>", f"{P}.heartbeat.scheduler",
                      f"{P}.engine.cache_events", f"{P}.ping.tokenizer", _inbox("tokenizer")],
    },
    "scheduler": {
        "publish": [f"{P}.engine.*.executor.>", f"{P}.detokenizer.>",
                    f"{P}.engine.cache_events", f"{P}.heartbeat.scheduler"],
        "subscribe": [f"{P}.engine.>", f"{P}.heartbeat.*", f"{P}.ping.scheduler",
                      _inbox("scheduler")],
    },
    "executor": {
        "publish": [f"{P}.heartbeat.executor"],
        "subscribe": [f"{P}.engine.*.executor.>", f"{P}.ping.executor"],
    },
    "detokenizer": {
        "publish": [f"{P}.api.*.deltas", f"{P}.engine.abort", f"{P}.heartbeat.detokenizer"],
        "subscribe": [f"{P}.detokenizer.>", f"{P}.ping.detokenizer"],
    },
    "observer": {
        "publish": [f"{P}.engine.stats", f"{P}.engine.*.stats", f"{P}.ping.*"],
        "subscribe": [f"{P}.heartbeat.*", "_INBOX.>"],
    },
}


def generate_passwords() -> dict[str, str]:
    return {user: secrets.token_urlsafe(24) for user in PERMISSIONS}


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
            "# services/nats_auth.py by `python -m services.nats_auth`; a test keeps it current.\n"
            + text)


def compose_env() -> str:
    """A .env file for compose.yaml: a random password for every bus user and an API key."""
    lines = [f"{password_variable(user)}={password}"
             for user, password in generate_passwords().items()]
    return "\n".join([*lines, f"LLMBUS_API_KEY={secrets.token_urlsafe(32)}"]) + "\n"


def server_config(host: str, port: int, passwords: dict[str, str] | None,
                  tls: tuple[str, str] | None = None) -> str:
    """A nats-server configuration (JSON is valid NATS config): with `passwords`, one user per
    service; with `tls` (certificate file, key file), TLS required of every client."""
    text = f"host: {json.dumps(host)}\nport: {port}\n"
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
