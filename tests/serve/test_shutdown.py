"""SIGTERM: the server stops accepting at once (a request whose body is still arriving is answered 503), lets a
short stream finish within --shutdown-timeout, cancels a long one after it (which ends with finish_reason "abort"
and [DONE]), and exits 0."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.serve.conftest import Server


def _read(server: Server, body: dict, first: threading.Event, out: dict, key: str) -> None:
    lines = []
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first.set()
    except httpx.HTTPError as e:  # the connection closed mid-stream
        out[key + "_error"] = e
    out[key] = lines
    first.set()


def test_sigterm_finishes_short_requests_cancels_long_ones_and_exits_0(peaked_dir, tmp_path):
    server = Server(["--hf", str(peaked_dir), "--max-context", "512", "--shutdown-timeout", "0.5"],
                    tmp_path / "server.log")
    try:  # two at once first: the 2-row step is compiled before the clock runs
        server.post("/v1/completions", {"prompt": ["the fox", "the dog"], "max_tokens": 4})
        # a request whose body is still on its way when the signal comes (its headers sent now, long before):
        # answered 503, not run
        body = json.dumps({"prompt": "the fox", "max_tokens": 4}).encode()
        url = urlsplit(server.url)
        late = socket.create_connection((url.hostname, url.port), timeout=30)
        late.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        out: dict = {}
        started = {k: threading.Event() for k in ("short", "long")}
        bodies = {"short": {"prompt": "the fox", "max_tokens": 4, "temperature": 0, "stream": True},
                  "long": {"prompt": "the dog", "max_tokens": 480, "temperature": 0, "stream": True, "n": 3}}
        readers = [threading.Thread(target=_read, args=(server, bodies[k], started[k], out, k)) for k in bodies]
        readers[1].start()
        assert started["long"].wait(30)
        readers[0].start()
        assert started["short"].wait(30)
        server.proc.send_signal(signal.SIGTERM)
        t = time.monotonic()
        time.sleep(0.2)
        late.sendall(body[5:])
        answer = b""
        while chunk := late.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer and answer.split(b"\r\n\r\n", 1)[1].rstrip().endswith(b"}"):
                break
        late.close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert json.loads(payload)["error"]["code"] == "unavailable"
        assert server.proc.wait(30) == 0, server.log()
        assert time.monotonic() - t < 15
        for r in readers:
            r.join(30)
        assert out["short"][-1] == "data: [DONE]" and '"finish_reason": "length"' in out["short"][-2]
        assert out["long"][-1] == "data: [DONE]" and len(out["long"]) < 3 * 480  # cancelled at the timeout
        assert sum('"finish_reason": "abort"' in line for line in out["long"]) == 3 and "long_error" not in out
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=5)
        assert "Traceback" not in server.log(), server.log()
    finally:
        server.stop()
