"""Two local CPU processes joined through a local coordinator (jax.distributed) train one sharded model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxformer.train.metrics import read_metrics
from tests.train.helpers import make_corpus, tiny_raw, write_config

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1)  # a worker that hangs prints every thread's stack before it is killed
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
from jaxformer.train import config as C
from jaxformer.train.loop import train
cfg = C.load(sys.argv[1], [f"mesh.process_id={sys.argv[3]}"])
out = train(cfg, sys.argv[2])
assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
print("LOSS", out["loss"])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(tmp_path: Path, timeout: float) -> tuple[list[int | None], list[tuple[str, str]], Path]:
    """Two processes train one tiny model on a data=2 x fsdp=2 mesh of their 4 CPU devices (gloo collectives):
    ``(return codes, [(stdout, stderr)], run dir)``. A worker still running after ``timeout`` seconds (one normally
    takes ~20-35 s on 2 cores) is sent SIGUSR1, which prints its threads' stacks to its stderr, then killed: its
    return code is None. Also run many times over by ``experiments/multihost_repeat.py``."""
    corpus = make_corpus(tmp_path / "corpus")
    raw = tiny_raw(corpus, steps=3, mesh={"data": 2, "fsdp": 2, "distributed": True,
                                           "coordinator_address": f"127.0.0.1:{_free_port()}",
                                           "num_processes": 2})
    cfg = write_config(tmp_path / "cfg.yaml", raw)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    run = tmp_path / "run"
    # Output to files, not pipes: read one after the other, a worker's full pipe would block it mid-collective
    # while the other waits on it; and a worker left behind is killed, never orphaned.
    logs = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(2)]
    procs, codes = [], []
    try:
        for i, (out, err) in enumerate(logs):
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(cfg), str(run), str(i)], env=env,
                                              stdout=fo, stderr=fe))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        hung = [p for p, c in zip(procs, codes) if c is None]
        for p in hung:
            p.send_signal(signal.SIGUSR1)
        time.sleep(2 if hung else 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, [(out.read_text(), err.read_text()) for out, err in logs], run


@pytest.mark.slow
def test_two_processes_train_one_model(tmp_path):
    codes, outs, run = run_workers(tmp_path, timeout=300)
    for i, (code, (_, err)) in enumerate(zip(codes, outs)):
        assert code == 0, (f"worker {i}: " + ("still running after 300 s (its stacks at the end)" if code is None
                                              else f"exit {code}") + "\n" + err[-6000:])
    losses = [float(line.split()[1]) for out, _ in outs for line in out.splitlines() if line.startswith("LOSS")]
    assert len(losses) == 2 and losses[0] == losses[1]  # one global computation, seen by both processes
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (run / "checkpoints" / "3").is_dir()


def test_repeat_script_keeps_the_stack_frames_that_say_where_a_worker_hung():
    import importlib.util

    spec = importlib.util.spec_from_file_location("multihost_repeat", REPO / "experiments" / "multihost_repeat.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    err = (f"W1206 a warning\nThread 0x01 (most recent call first):\n"
           f'  File "/x/site-packages/jax/_src/api.py", line 1 in f\n'
           f'  File "/x/site-packages/orbax/checkpoint/checkpoint_manager.py", line 2 in save\n'
           f'  File "{REPO}/jaxformer/train/checkpoint.py", line 3 in save\n')
    assert mod.stacks(err).splitlines() == ["Thread 0x01 (most recent call first):",
                                            '  File "/x/site-packages/orbax/checkpoint/checkpoint_manager.py", '
                                            "line 2 in save",
                                            f'  File "{REPO}/jaxformer/train/checkpoint.py", line 3 in save']
    assert mod.stacks("no dump") == "(no stacks)"
