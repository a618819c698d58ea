"""Loading a Hugging Face checkpoint: ``load_pretrained`` vs a naive whole-file load, time and peak memory.

A random LLaMA-shaped checkpoint (default the ``llama3_1b`` preset: Llama 3.2 1B,
1.24 B parameters, tied embeddings) is written once as transformers writes one:
``config.json`` (the family's ``config_to_hf``), bf16 tensors under their HF names in
sharded safetensors (``--shard-mb``, 1 GB like ``max_shard_size="1GB"``) with a
``model.safetensors.index.json``. Each tensor is drawn with numpy straight into its
shard, so no whole model (let alone a float32 one) is ever built; the directory
(default ``runs/bench/hf_llama_1b/``) is reused while its ``bench_meta.json``
(written last) matches. Every tensor's CRC-32 goes into that file.

Then each method loads it with ``dtype="bfloat16"`` in a fresh subprocess (the page
cache warm: every file is read once before the first load, so all methods read
from memory):

* ``naive``: ``safetensors.numpy.load_file`` of every shard (whole files in
  memory), then the same rules turn them into the state;
* ``load_pretrained``: ``jaxformer.interop.hf.load_pretrained`` (tensor by tensor);
* ``load_pretrained + shardings``: the same onto 8 CPU devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), FSDP-style: each
  parameter's first axis split 8 ways where it divides, replicated otherwise.

Seconds: wall time of the load call (state blocked until ready). Peak: the
resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
minus the resident set just before the call (after imports and a warm-up: the backend
up, the model traced once by ``abstract_init``),
against the checkpoint's tensor bytes (goal < 1.5x; the loaded bf16 state alone is
1.0x). Held: resident set after the load minus the same baseline. After the
measurement each worker maps every parameter back to its HF tensors (the rules'
``save``) and compares CRC-32s with what was written: the ``params`` column.

    python experiments/bench/hf_load.py                 # 1B; writes experiments/results/hf_load.md
    python experiments/bench/hf_load.py --small --dir /tmp/hf_tiny --out /tmp/hf_tiny/table.md   # seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

from procmem import proc_kb, reset_hwm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METHODS = ("naive", "load_pretrained", "sharded")
LABEL = {"naive": "naive: load_file every shard, then build", "load_pretrained": "load_pretrained",
         "sharded": "load_pretrained + shardings"}
META = "bench_meta.json"


# --------------------------------------------------------------------------- the checkpoint


def bench_config(preset: str):
    from jaxformer.model import presets

    return presets.get(preset, param_dtype="bfloat16", compute_dtype="bfloat16")


def _order(name: str):
    """transformers' state-dict order: embeddings, layers by number, final norm, head."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return (0 if "embed" in name else 1 if m else 2 if name.startswith("model.") else 3,
            int(m.group(1)) if m else 0, name)


def hf_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the llama family writes for ``config``, name -> shape, in transformers' order."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxformer.interop import hf

    family = hf.families()["llama"]
    _, abstract = hf.abstract_init(config)
    params = {tuple(p): v for p, v in nnx.to_flat_state(abstract)}
    out = {}
    for rule in family.rules(config):
        shapes = jax.eval_shape(rule.save, *[jax.ShapeDtypeStruct(params[p].shape, np.float32) for p in rule.jax])
        out.update({n: tuple(s.shape) for n, s in zip(rule.hf, shapes, strict=True)})
    return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def crc(a) -> int:
    import numpy as np

    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def shard_files(path: Path) -> list[str]:
    from jaxformer.interop.hf import INDEX, SINGLE

    if (path / INDEX).is_file():
        return sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
    return [SINGLE]


def _meta_ok(path: Path, want: dict) -> dict | None:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if any(meta.get(k) != v for k, v in want.items()):
        return None
    if any(not (path / f).is_file() or (path / f).stat().st_size != n for f, n in meta["file_bytes"].items()):
        return None
    return meta


def write_checkpoint(path: Path, preset: str, shard_bytes: int, seed: int) -> dict:
    """The random bf16 checkpoint at ``path`` (reused when complete); returns its ``bench_meta.json``."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from jaxformer.interop import hf

    config = bench_config(preset)
    want = dict(preset=preset, shard_bytes=shard_bytes, seed=seed, config=config.model_dump(mode="json"))
    meta = _meta_ok(path, want)
    if meta is not None:
        print(f"reusing {path} ({meta['tensor_bytes'] / 1e9:.2f} GB)", file=sys.stderr, flush=True)
        return meta
    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    for stale in [path / META, path / hf.SINGLE, path / hf.INDEX, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    shapes = hf_tensor_shapes(config)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    # shards in order, each at most shard_bytes (a tensor larger than that gets one of its own)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * bf16.itemsize
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    files = [hf.SINGLE] if len(groups) == 1 else \
        [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    crcs, weight_map = {}, {}
    for file, names in zip(files, groups, strict=True):
        shard = {}
        for name in names:
            rng = np.random.default_rng([seed, list(shapes).index(name)])
            a = rng.standard_normal(shapes[name], dtype=np.float32)
            a *= 0.02
            if name.endswith("norm.weight"):
                a += 1.0
            shard[name] = a.astype(bf16)
            del a
            crcs[name] = crc(shard[name])
            weight_map[name] = file
        save_file(shard, str(path / file), metadata={"format": "pt"})
        del shard
        print(f"  wrote {file}", file=sys.stderr, flush=True)
    total = sum(int(np.prod(s)) * bf16.itemsize for s in shapes.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / hf.INDEX).write_text(json.dumps(index, indent=2) + "\n")
    hfc = {**hf.families()["llama"].config_to_hf(config), "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    (path / hf.CONFIG).write_text(json.dumps(hfc, indent=2, sort_keys=True) + "\n")
    meta = dict(want, n_params=sum(int(np.prod(s)) for s in shapes.values()), tensor_bytes=total,
                file_bytes={f: (path / f).stat().st_size for f in files}, crc=crcs,
                write_seconds=time.perf_counter() - t0)
    (path / META).write_text(json.dumps(meta, indent=1) + "\n")  # last: marks the directory complete
    print(f"wrote {path} ({total / 1e9:.2f} GB) in {meta['write_seconds']:.0f}s", file=sys.stderr, flush=True)
    return meta


# --------------------------------------------------------------------------- the worker (a fresh process)


def naive_load(path: Path, dtype: str):
    """What a loader without memory care does: every shard whole into memory, then the same rules."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from safetensors.numpy import load_file

    from jaxformer.interop import hf

    tensors = {}
    for file in shard_files(path):
        tensors.update(load_file(str(path / file)))
    config = hf.config_from_hf(hf.read_config(path), dtype=dtype)
    graphdef, abstract = hf.abstract_init(config)
    params = {tuple(p): v for p, v in nnx.to_flat_state(abstract)}
    target = hf.as_dtype(dtype)
    loaded = {}
    for rule in hf.families()["llama"].rules(config):
        outs = rule.load(*[tensors[n].astype(np.float32) for n in rule.hf])
        for p, a in zip(rule.jax, outs, strict=True):
            loaded[p] = jnp.asarray(np.ascontiguousarray(a).astype(target))
    state = nnx.from_flat_state([(p, params[p].replace(loaded[p])) for p in params])
    return config, graphdef, state


def fsdp_shardings(abstract, devices):
    """First axis split over all devices where it divides, replicated otherwise (a state-shaped tree)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(devices), ("fsdp",))
    n = len(devices)
    return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec("fsdp") if s.ndim and s.shape[0] % n == 0
                                                else PartitionSpec()), abstract)


def _value(v):
    from flax import nnx

    return v.get_value() if isinstance(v, nnx.Variable) else v


def worker(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from flax import nnx
    from safetensors import safe_open  # noqa: F401  (imported before the baseline, like everything else)
    from safetensors.numpy import load_file  # noqa: F401

    from jaxformer.interop import hf

    path, method, dtype = Path(case["dir"]), case["method"], "bfloat16"
    shardings, n_sharded = None, 0
    if method == "sharded":
        devices = jax.devices()
        if len(devices) != case["devices"]:
            raise SystemExit(f"expected {case['devices']} CPU devices, got {len(devices)} (XLA_FLAGS not applied?)")
        _, abstract = hf.abstract_init(hf.config_from_hf(hf.read_config(path), dtype=dtype))
        shardings = fsdp_shardings(abstract, devices)
        n_sharded = sum(len(_value(s).spec) > 0 for _, s in nnx.to_flat_state(shardings))
        jax.block_until_ready(jax.device_put(np.ones((len(devices), 4), ml_dtypes.bfloat16),
                                             jax.tree.leaves(shardings)[0]))  # warm-up
    hf.abstract_init(hf.config_from_hf(hf.read_config(path), dtype=dtype))  # warm-up: the model traced once
    jax.block_until_ready(jnp.asarray(np.ones(16, ml_dtypes.bfloat16)) + 1)  # warm-up: backend up
    gc.collect()
    hwm_reset = reset_hwm()
    rss0 = proc_kb("VmRSS")
    t0 = time.perf_counter()
    if method == "naive":
        config, _, state = naive_load(path, dtype)
    else:
        config, _, state = hf.load_pretrained(path, dtype=dtype, shardings=shardings)
    jax.block_until_ready(jax.tree.leaves(state))
    seconds = time.perf_counter() - t0
    hwm, rss1 = proc_kb("VmHWM"), proc_kb("VmRSS")
    rss_file = proc_kb("RssFile")
    # verify: every parameter back to its HF tensors, CRC-32 of each
    params = {tuple(p): _value(v) for p, v in nnx.to_flat_state(state)}
    dtypes = sorted({str(a.dtype) for a in params.values()})
    crcs = {}
    for rule in hf.families()["llama"].rules(config):
        outs = rule.save(*[np.asarray(jax.device_get(params[p])).astype(np.float32) for p in rule.jax])
        crcs.update({n: crc(np.asarray(o).astype(ml_dtypes.bfloat16)) for n, o in zip(rule.hf, outs, strict=True)})
    shard_counts = sorted({len(a.sharding.device_set) for a in params.values()})
    return dict(method=method, seconds=seconds, peak_bytes=(hwm - rss0) * 1024, held_bytes=(rss1 - rss0) * 1024,
                rss_file_after=rss_file * 1024, baseline_bytes=rss0 * 1024, hwm_reset=hwm_reset,
                n_devices=jax.device_count(), device_sets=shard_counts, n_sharded=n_sharded,
                dtypes=dtypes, crc=crcs)


def run_workers(cases: list[dict], parallel: bool = False) -> list[dict]:
    """Each case in a fresh process, one after another (``parallel``: all at once, for --small only, where
    the numbers mean nothing and only the path is exercised)."""
    procs, out = [], []
    for case in cases:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
        if case["method"] == "sharded":
            flags = f"{flags} --xla_force_host_platform_device_count={case['devices']}".strip()
        env["XLA_FLAGS"] = flags
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(case)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                      env=env))
        if not parallel:
            out.append(_result(case, procs[-1]))
    return out if not parallel else [_result(c, p) for c, p in zip(cases, procs, strict=True)]


def _result(case: dict, proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"worker {case['method']} failed (rc={proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main


def warm_page_cache(path: Path, files: list[str]) -> None:
    buf = bytearray(64 << 20)
    for f in files:
        with open(path / f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def table(meta: dict, results: dict[str, list[dict]], devices: int) -> tuple[str, dict]:
    ckpt = meta["tensor_bytes"]
    rows, summary = [], {}
    for method in METHODS:
        runs = results.get(method)
        if not runs:
            continue
        sec = statistics.median(r["seconds"] for r in runs)
        peak = max(r["peak_bytes"] for r in runs)
        held = statistics.median(r["held_bytes"] for r in runs)
        ok = all(r["crc"] == meta["crc"] and r["dtypes"] == ["bfloat16"] for r in runs)
        summary[method] = dict(seconds=sec, peak_bytes=peak, ok=ok)
        dev = runs[0]["n_devices"]
        rows.append(f"| {LABEL[method]} | {dev} | {sec:.3g} | {ckpt / sec / 1e9:.3g} | {peak / 1e6:,.1f} "
                    f"| {peak / ckpt:.2f}x | {held / 1e6:,.1f} | {'ok' if ok else 'MISMATCH'} |")
    lines = ["| method | devices | seconds | GB/s | peak RSS above baseline MB | peak / checkpoint "
             "| held after MB | params |", "|---|---:|---:|---:|---:|---:|---:|---|", *rows]
    return "\n".join(lines), summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="llama_tiny, tiny shards, the loads run concurrently: a "
                                                         "seconds-long end-to-end check, its numbers meaningless")
    ap.add_argument("--preset", default=None, help="model preset (default llama3_1b; llama_tiny with --small)")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default runs/bench/hf_llama_1b, "
                                                "runs/bench/hf_llama_tiny with --small); reused when complete")
    ap.add_argument("--shard-mb", type=float, default=None,
                    help="max shard size in MB (default 1000; 0.1 with --small)")
    ap.add_argument("--devices", type=int, default=8, help="CPU devices of the sharded load")
    ap.add_argument("--repeats", type=int, default=1, help="fresh-process loads per method (median s, max peak)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the markdown here (default experiments/results/hf_load.md; "
                                                "none with --small)")
    ap.add_argument("--json", default=None, help="also write every worker's raw result here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    preset = args.preset or ("llama_tiny" if args.small else "llama3_1b")
    path = Path(args.dir or os.path.join(ROOT, "runs", "bench", "hf_llama_tiny" if args.small else "hf_llama_1b"))
    shard_bytes = int(1e6 * (args.shard_mb if args.shard_mb is not None else 0.1 if args.small else 1000))
    out = args.out if args.out is not None else (None if args.small else
                                                 os.path.join(ROOT, "experiments", "results", "hf_load.md"))
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"--methods: unknown {sorted(unknown)} (choose from {METHODS})")

    meta = write_checkpoint(path, preset, shard_bytes, args.seed)
    files = list(meta["file_bytes"])
    warm_page_cache(path, files)
    results: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(args.repeats):  # alternate methods, so a busy machine slows all alike
        cases = [dict(dir=str(path), method=method, devices=args.devices) for method in methods]
        for method, r in zip(methods, run_workers(cases, parallel=args.small), strict=True):
            results[method].append(r)
            print(f"  {method:<16} {r['seconds']:7.2f}s peak {r['peak_bytes'] / 1e9:6.2f} GB "
                  f"held {r['held_bytes'] / 1e9:6.2f} GB (file-backed after {r['rss_file_after'] / 1e9:.2f} GB) "
                  f"params {'ok' if r['crc'] == meta['crc'] else 'MISMATCH'}", file=sys.stderr, flush=True)
    tab, summary = table(meta, results, args.devices)
    command = "python experiments/bench/hf_load.py " + " ".join(argv if argv is not None else sys.argv[1:])
    ckpt = meta["tensor_bytes"]
    text = [f"# Loading a Hugging Face checkpoint ({preset}, bf16)", "", f"`{command.strip()}`", "",
            f"Checkpoint: {meta['n_params']:,} parameters, {ckpt / 1e6:,.1f} MB of bf16 tensors in {len(files)} "
            f"safetensors file(s) (random values, LLaMA names and shapes, written by this script). "
            f"Loaded with `dtype=\"bfloat16\"`, each method in a fresh process"
            f"{' (all at once: --small checks the path, its numbers mean nothing)' if args.small else ''}, "
            "page cache warm; "
            f"{os.cpu_count()} CPU cores shared with other jobs (load average {os.getloadavg()[0]:.1f} at the end); "
            f"{args.repeats} load(s) per method (median seconds, max peak).", "",
            "Peak: VmHWM (reset before the load) minus VmRSS just before it (after imports and a warm-up); "
            "held: VmRSS after the load minus the same baseline; MB = 1e6 bytes, GB = 1e9; GB/s = checkpoint bytes / "
            "seconds. params: every loaded parameter mapped back to its HF tensors matches the written "
            "CRC-32s.", "", tab, ""]
    if "naive" in summary and "load_pretrained" in summary:
        n, lp = summary["naive"], summary["load_pretrained"]
        text += [f"load_pretrained: peak {lp['peak_bytes'] / ckpt:.2f}x the checkpoint (goal < 1.5x: "
                 f"{'met' if lp['peak_bytes'] / ckpt < 1.5 else 'MISSED'}), "
                 f"{n['peak_bytes'] / lp['peak_bytes']:.2f}x less than the naive load's "
                 f"{n['peak_bytes'] / ckpt:.2f}x; {n['seconds'] / lp['seconds']:.2f}x the naive load's speed.", ""]
    print("\n".join(text))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        Path(out).write_text("\n".join(text))
        print(f"wrote {out}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta={k: v for k, v in meta.items() if k != "config"},
                                                   results=results), indent=1))
    return 0 if all(s["ok"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
