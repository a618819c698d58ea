"""The real server process for the serve tests: ``python -m jaxformer.cli serve ...`` on a free port of
127.0.0.1, driven over HTTP (the official ``openai`` client, and ``httpx`` for raw bodies)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "interop" / "fixtures"
# A template in the fixture's vocabulary (ASCII letters, ':', '.', ' '): bos_token is the tokenizer's own
# <|begin_of_text|>, an added token the template writes as text.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peaked_llama3(out: Path, *, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """The committed llama3 fixture (tied embeddings) with its embedding scaled by 8: the logits (the tied
    head over an RMS-normed state) are 8x as far apart, so greedy decoding is never decided by float rounding
    between one batch and another; plus a chat template in tokenizer_config.json."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(FIXTURES / "llama3", out)
    weights = load_file(out / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * np.float32(8.0)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    if chat_template is not None:
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": chat_template}, indent=2))
    return out


class Server:
    """One ``jaxformer serve`` process; ``args`` name the model and the limits."""

    def __init__(self, args: list[str], log: Path, *, ready_timeout: float = 180.0, tries: int = 3):
        self.log_path = log
        self._openai = None
        for attempt in range(tries):  # a port picked free may be taken before the server binds it
            if self._start(args, ready_timeout):
                return
            if attempt == tries - 1 or "address already in use" not in self.log().lower():
                raise RuntimeError(f"jaxformer serve exited {self.proc.returncode}:\n{self.log()}")

    def _start(self, args: list[str], ready_timeout: float) -> bool:
        """Start the process on a free port; True once it answers /health itself (its own pid), False if it
        exited first."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxformer.cli", "serve", *args, "--host", "127.0.0.1",
                                      "--port", str(self.port), "--log-level", "warning"],
                                     cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=120)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                self.http.close()
                self._log.close()
                return False
            try:
                r = self.http.get("/health")
                if r.status_code == 200 and r.json().get("pid") == self.proc.pid:  # not another test's server
                    return True
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"jaxformer serve not ready after {ready_timeout} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-4000:]

    def client(self):
        """One official ``openai`` client (thread-safe; closed with the server: no socket left to the GC)."""
        import openai

        if self._openai is None:
            self._openai = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return self._openai

    def post(self, path: str, body, **kw) -> httpx.Response:
        if isinstance(body, (dict, list)):
            return self.http.post(path, json=body, **kw)
        return self.http.post(path, content=body, headers={"content-type": "application/json"}, **kw)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{"name{labels}": value}`` (labels as Prometheus prints them)."""
        text = self.http.get("/metrics").text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_metrics(self, predicate, timeout: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics never satisfied the condition: {m}")
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()
        if self._openai is not None:
            self._openai.close()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory) -> Path:
    return peaked_llama3(tmp_path_factory.mktemp("serve") / "tiny-llama3")
