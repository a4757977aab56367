"""Which NATS servers a service uses and how it reaches them: the `--nats-url` list, TLS, and
how fast a dead server is noticed."""

from __future__ import annotations

import os
import random
import ssl
from typing import Any

# A server that dies with its host, or a partition (no RST), is noticed only by unanswered
# pings: nats-py's default (a ping every 120 s, 2 outstanding) takes minutes. One a second, and
# the connection is stale when a third goes out with two unanswered: noticed 2-3 s after the
# last answer, while an event loop held up for under 2 s is not taken for a dead server. The
# client then reconnects to another server of the cluster at once (a killed server's RST is
# noticed at once). bus/liveness.py's DEAD_AFTER is longer than that detection plus the
# reconnect, so a copy whose server died is not given up on while it reconnects.
PING_INTERVAL = 1
MAX_OUTSTANDING_PINGS = 2
# nats-py closes a lost connection gracefully before it tries the next server. Over TLS, with
# data still queued for a server cut off without an RST, that close waits until TCP gives up
# (seen: 30 s, every copy on that server reconnecting to none meanwhile, issue 46's compound
# case). A close still waited for after this long is cut short: the connection is dropped.
STUCK_CLOSE_SECONDS = 1.0


class StuckClose:
    """Watches a client's reconnections (`check`, called now and then): the connection being
    left is aborted, unsent data and all, once its graceful close has taken
    STUCK_CLOSE_SECONDS. It reads nats-py's private transport (nats-py is pinned): the client
    has no way to say "drop it now"."""

    def __init__(self) -> None:
        self.writer: Any = None  # the stream writer of the connection being left
        self.since = 0.0

    def check(self, client: Any, now: float) -> bool:
        """True when it aborted a connection."""
        transport = getattr(client, "_transport", None)
        writer = getattr(transport, "_io_writer", None)
        if not client.is_reconnecting or writer is None:
            self.writer = None
            return False
        if writer is not self.writer:  # a reconnection began, or moved on to a new server
            self.writer, self.since = writer, now
            return False
        if now - self.since < STUCK_CLOSE_SECONDS or not writer.transport.is_closing():
            return False  # a close still in time, or a connection being made
        writer.transport.abort()
        bare = getattr(transport, "_bare_io_writer", None)  # under TLS: the TCP connection
        if bare is not None and bare is not writer:
            bare.transport.abort()
        self.writer = None
        return True

# Where a tls:// bus URL's server certificate is checked: a CA bundle, or the server's own
# self-signed certificate (what `llmbus up --nats-tls-cert` sets for its services).
TLS_CA_VARIABLE = "LLMBUS_NATS_TLS_CA"


def server_urls(nats_url: str) -> list[str]:
    """The servers of a `--nats-url`: one URL, or a comma-separated list, the seeds of a NATS
    cluster (the client tries them in turn, reconnects to any, and learns the cluster's other
    servers from the one it reaches). ValueError for an empty entry, or tls:// mixed with
    nats:// (the client applies one TLS setting to every server)."""
    urls = [url.strip() for url in nats_url.split(",")]
    if not all(urls):
        raise ValueError(f"--nats-url {nats_url!r}: an empty server in the list")
    if len({url.startswith("tls://") for url in urls}) > 1:
        raise ValueError(f"--nats-url {nats_url!r}: every server tls://, or none")
    return urls


def connect_order(urls: list[str], rng: random.Random | None = None) -> list[str]:
    """The order a client tries `urls` in: the first as the user put it (its own host's
    server), the others shuffled. Copies given the same list then fall back to different
    servers when their first is lost, instead of all landing on the second entry at once
    (and all losing it together if it fails next)."""
    rest = urls[1:]
    (rng or random.Random()).shuffle(rest)
    return urls[:1] + rest


def tls_options(nats_url: str) -> dict[str, ssl.SSLContext]:
    """nats.connect's TLS options for `nats_url`: none for nats://; for tls://, a context that
    verifies the server against $LLMBUS_NATS_TLS_CA, or the system's CAs when unset."""
    if not server_urls(nats_url)[0].startswith("tls://"):
        return {}
    return {"tls": ssl.create_default_context(cafile=os.environ.get(TLS_CA_VARIABLE) or None)}
