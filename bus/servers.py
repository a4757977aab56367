"""Which NATS servers a service uses and how it reaches them: the `--nats-url` list, TLS, and
how fast a dead server is noticed."""

from __future__ import annotations

import os
import ssl

# A server that dies with its host, or a partition (no RST), is noticed only by unanswered
# pings: nats-py's default (a ping every 120 s, 2 outstanding) takes minutes. One a second, and
# the connection counts as stale when 3 are unanswered: noticed within 3-4 s, while an event
# loop held up for under 3 s (a long step's planning, a GC pause) is not taken for a dead
# server. The client then reconnects to another server of the cluster at once.
PING_INTERVAL = 1.0
MAX_OUTSTANDING_PINGS = 3

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


def tls_options(nats_url: str) -> dict[str, ssl.SSLContext]:
    """nats.connect's TLS options for `nats_url`: none for nats://; for tls://, a context that
    verifies the server against $LLMBUS_NATS_TLS_CA, or the system's CAs when unset."""
    if not server_urls(nats_url)[0].startswith("tls://"):
        return {}
    return {"tls": ssl.create_default_context(cafile=os.environ.get(TLS_CA_VARIABLE) or None)}
