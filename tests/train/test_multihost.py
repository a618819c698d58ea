"""Two local CPU processes joined through a local coordinator (jax.distributed) train one sharded model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxformer.train.metrics import read_metrics
from tests.train.helpers import make_corpus, tiny_raw, write_config

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import sys
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


@pytest.mark.slow
def test_two_processes_train_one_model(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    raw = tiny_raw(corpus, steps=3, mesh={"data": 2, "fsdp": 2, "distributed": True,
                                           "coordinator_address": f"127.0.0.1:{_free_port()}",
                                           "num_processes": 2})
    cfg = write_config(tmp_path / "cfg.yaml", raw)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    run = tmp_path / "run"
    # Output to files, not pipes: read one after the other, a worker's full pipe would block it mid-collective
    # while the other waits on it (a deadlock); and a worker left behind is killed, never orphaned.
    logs = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(2)]
    procs = []
    try:
        for i, (out, err) in enumerate(logs):
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(cfg), str(run), str(i)], env=env,
                                              stdout=fo, stderr=fe))
        for p in procs:
            p.wait(timeout=300)  # ~35 s on 2 cores
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = [(out.read_text(), err.read_text()) for out, err in logs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    losses = [float(line.split()[1]) for out, _ in outs for line in out.splitlines() if line.startswith("LOSS")]
    assert len(losses) == 2 and losses[0] == losses[1]  # one global computation, seen by both processes
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (run / "checkpoints" / "3").is_dir()
