"""Credentials and subject permissions for the embedded nats-server (`llmbus up`).

Each service connects as its own user with a random password and may publish and subscribe
only where the pipeline needs it, so a client without credentials cannot publish into the
pipeline, and a compromised stage cannot impersonate another. Replies to requests a service
received are allowed by `allow_responses`. The `observer` user (tests, dashboards) may read
heartbeats and ask for stats, nothing else.

Services read their credentials from LLMBUS_NATS_USER / LLMBUS_NATS_PASSWORD (not from the
command line, which `ps` shows). For TLS, add a `tls { cert_file, key_file }` block to the
server configuration and connect with `tls://` URLs; see README.
"""

from __future__ import annotations

import json
import secrets

P = "llmbus.v1"
INBOX = "_INBOX.>"

PERMISSIONS: dict[str, dict[str, list[str]]] = {
    "api": {
        "publish": [f"{P}.tokenizer.generate", f"{P}.tokenizer.encode", f"{P}.tokenizer.decode",
                    f"{P}.engine.abort", f"{P}.engine.model", f"{P}.engine.stats",
                    f"{P}.ping.*", f"{P}.heartbeat.api"],
        "subscribe": [f"{P}.api.*.deltas", f"{P}.heartbeat.*", f"{P}.ping.api", INBOX],
    },
    "tokenizer": {
        "publish": [f"{P}.engine.submit", f"{P}.engine.*.submit", f"{P}.heartbeat.tokenizer"],
        "subscribe": [f"{P}.tokenizer.>", f"{P}.heartbeat.scheduler",
                      f"{P}.engine.cache_events", f"{P}.ping.tokenizer", INBOX],
    },
    "scheduler": {
        "publish": [f"{P}.engine.*.executor.>", f"{P}.detokenizer.>",
                    f"{P}.engine.cache_events", f"{P}.heartbeat.scheduler"],
        "subscribe": [f"{P}.engine.>", f"{P}.heartbeat.*", f"{P}.ping.scheduler", INBOX],
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
        "subscribe": [f"{P}.heartbeat.*", INBOX],
    },
}


def generate_passwords() -> dict[str, str]:
    return {user: secrets.token_urlsafe(24) for user in PERMISSIONS}


def server_config(host: str, port: int, passwords: dict[str, str]) -> str:
    """A nats-server configuration with one user per service (JSON is valid NATS config)."""
    users = [{"user": user, "password": passwords[user], "permissions": {
        "publish": {"allow": perms["publish"]}, "subscribe": {"allow": perms["subscribe"]},
        "allow_responses": True}} for user, perms in PERMISSIONS.items()]
    return (f"host: {json.dumps(host)}\nport: {port}\n"
            f"authorization: {json.dumps({'users': users}, indent=2)}\n")
