"""`llmbus up` serving the default model: it starts, serves, ends a stream cleanly when
SIGTERM comes mid-answer, and leaves no process behind; its bus locks every stage to its own
user and subjects, over TLS too."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import subprocess

import nats
import pytest

from llmbus.bus import subjects
from llmbus.services.launcher import (
    SERVICE_ORDER,
    wait_for_port,
)
from tests.stack import (
    AUTH,
    MODEL_NAME,
    needs_default_model,
    processes_mentioning,
    start_stack,
    stop_stack,
)


@needs_default_model()
@pytest.mark.model
def test_up_serves_and_sigterm_mid_stream_ends_it_cleanly_and_leaves_no_process(tmp_path):
    stack = start_stack(tmp_path)
    port = int(stack.nats_url.rsplit(":", 1)[1])
    plain_url = f"nats://127.0.0.1:{port}"  # what the services get; credentials via env
    assert "observer:" in stack.nats_url
    password = stack.nats_url.split("observer:", 1)[1].split("@", 1)[0]
    assert password not in stack.log()  # the ready line names a file, not the password
    assert len(processes_mentioning(plain_url)) == 5  # one process per service
    assert wait_for_port("127.0.0.1", port, timeout=1)  # the embedded nats-server
    import httpx

    assert httpx.get(stack.base_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{stack.base_url}/chat/completions", json={
                "model": MODEL_NAME, "stream": True, "max_tokens": 60, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Count slowly."}]}) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        stack.process.send_signal(signal.SIGTERM)  # mid-answer
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" or any('"error"' in line for line in rest)
    assert stack.process.wait(60) == 0
    assert processes_mentioning(plain_url) == []
    assert not wait_for_port("127.0.0.1", port, timeout=0.5)
    log = stack.log()
    for name in SERVICE_ORDER:  # every line is prefixed with its service's name
        assert re.search(rf"^{name}\s+\| ", log, re.MULTILINE)


@pytest.mark.model  # the shared stack's bus
async def test_nats_needs_credentials_and_permissions(stack):
    """Without credentials nothing connects; the observer cannot publish into the pipeline."""
    plain = "nats://" + stack.nats_url.rsplit("@", 1)[1]
    with pytest.raises(Exception, match="(?i)authorization"):
        await nats.connect(plain, allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=2)
    errors = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    observer = await nats.connect(stack.nats_url, error_cb=on_error)
    try:
        await observer.publish(subjects.executor_step("engine0"), b"junk")
        await observer.flush()
        for _ in range(20):
            if errors:
                break
            await asyncio.sleep(0.1)
        assert any("permissions violation" in str(e).lower() for e in errors)
    finally:
        await observer.close()


@pytest.mark.model
async def test_no_stage_reads_replies_meant_for_another(stack):
    """Services take replies on inboxes of their own: the observer, listening on the shared
    `_INBOX.>`, hears none of the replies a request causes, and may not listen on the api's."""
    import httpx

    errors, heard = [], []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    async def on_reply(msg) -> None:
        heard.append(msg.subject)

    observer = await nats.connect(stack.nats_url, error_cb=on_error)
    try:
        await observer.subscribe("_INBOX.>", cb=on_reply)
        await observer.subscribe(f"{subjects.inbox_prefix('api')}.>", cb=on_reply)
        await observer.flush()
        async with httpx.AsyncClient(timeout=120) as http:
            response = await http.post(f"{stack.base_url}/completions", headers=AUTH, json={
                "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3})
        assert response.status_code == 200
        for _ in range(20):
            if errors:
                break
            await asyncio.sleep(0.1)
        assert heard == []  # the api's, tokenizer's and scheduler's replies went elsewhere
        assert any("permissions violation" in str(e).lower() for e in errors)
    finally:
        await observer.close()


@needs_default_model()
@pytest.mark.model
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate")
async def test_up_serves_the_bus_over_tls_only(tmp_path):
    """`--nats-tls-cert/--nats-tls-key`: the embedded bus speaks TLS only, the services reach
    it (a completion works), and only a client that trusts the certificate gets in."""
    import ssl

    import httpx

    cert, key = tmp_path / "bus.pem", tmp_path / "bus.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    stack = start_stack(tmp_path, "--nats-tls-cert", str(cert), "--nats-tls-key", str(key))
    try:
        assert stack.nats_url.startswith("tls://observer:")
        host, port = stack.nats_url.rsplit("@", 1)[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        info = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        assert b'"tls_required":true' in info.replace(b" ", b"")  # no plaintext clients
        async with httpx.AsyncClient(timeout=120) as http:
            response = await http.post(f"{stack.base_url}/completions", json={
                "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(Exception, match="(?i)certificate"):  # the system's CAs: refused
            await nats.connect(stack.nats_url, tls=ssl.create_default_context(),
                               allow_reconnect=False, max_reconnect_attempts=0,
                               connect_timeout=5)
        trusting = await nats.connect(stack.nats_url,
                                      tls=ssl.create_default_context(cafile=str(cert)))
        await trusting.close()
    finally:
        assert stop_stack(stack) == 0
