"""``experiments/bench/hf_load.py --small`` end to end (< 20 s): it writes a tiny sharded checkpoint, loads it
three ways in fresh processes, and its table parses; every method's loaded parameters (mapped back to HF tensors)
match the tensors in the files, read here independently with ``safetensors.numpy``."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[2]


def _row(cells: list[str]) -> dict:
    method, devices, seconds, gbs, peak, ratio, held, params = cells
    return dict(method=method, devices=int(devices), seconds=float(seconds), gbs=float(gbs),
                peak_mb=float(peak.replace(",", "")), ratio=float(ratio.rstrip("x")),
                held_mb=float(held.replace(",", "")), params=params)


@pytest.mark.slow  # 8 s: the benchmark script end to end (three fresh JAX processes); load_pretrained onto shardings
# is the fine-tunes' load (tests/interop/test_cli.py, test_scanned.py: step 1's loss is the checkpoint's), by default
def test_hf_load_bench_small(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    ckpt, out, raw = tmp_path / "ckpt", tmp_path / "table.md", tmp_path / "raw.json"
    # the script's own process runs here (one jax start saved); each load still runs in a fresh subprocess
    bench = load_bench("hf_load")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    assert bench.main(["--small", "--dir", str(ckpt), "--out", str(out), "--json", str(raw)]) == 0

    lines = [ln for ln in out.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| method")]
    rows = [_row([c.strip() for c in ln.strip("|").split("|")]) for ln in lines]
    assert [r["devices"] for r in rows] == [1, 1, 8]
    assert [r["method"] for r in rows][1:] == ["load_pretrained", "load_pretrained + shardings"]
    for r in rows:
        assert r["seconds"] > 0 and r["gbs"] > 0 and r["ratio"] > 0 and r["peak_mb"] >= 0, r
        assert r["params"] == "ok", r

    # the checkpoint as transformers lays it out: shards + index + config
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and json.loads((ckpt / "config.json").read_text())["model_type"] == "llama"
    # what is in the files, read here, is what every method loaded
    written = {}
    for f in files:
        for name, a in load_file(str(ckpt / f)).items():
            assert str(a.dtype) == "bfloat16", (name, a.dtype)
            written[name] = zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    assert written.keys() == index["weight_map"].keys()
    results = json.loads(raw.read_text())["results"]
    assert sorted(results) == ["load_pretrained", "naive", "sharded"]
    for method, runs in results.items():
        for r in runs:
            assert r["crc"] == written, method
            assert r["dtypes"] == ["bfloat16"], method
    assert results["sharded"][0]["n_devices"] == 8 and results["sharded"][0]["n_sharded"] > 0
    assert max(results["sharded"][0]["device_sets"]) == 8
