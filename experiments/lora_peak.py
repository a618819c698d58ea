"""Study 11's peak memory and step time: each arm trained 8 steps in its own process (so the peak RSS is that
arm's alone: the sweep runs every point in one process), on an idle machine.

    python experiments/lora_peak.py          # prints one line per arm; writes /tmp/peak.json
"""
import json, resource, subprocess, sys, time, shutil
from pathlib import Path
ARMS = {"full fine-tune": "model.lora=null", "LoRA r4": "model.lora={rank: 4, alpha: 8}",
        "LoRA r16": "model.lora={rank: 16, alpha: 32}",
        "LoRA r16 attention": "model.lora={rank: 16, alpha: 32, targets: [w_q, w_k, w_v, w_o]}"}
out = {}
for name, arm in ARMS.items():
    d = Path("/tmp/peak_runs") / name.replace(" ", "_")
    shutil.rmtree(d, ignore_errors=True)
    # one process per arm, so its peak RSS is that arm's alone
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    cmd = [sys.executable, "-c", code, ".venv/bin/jaxformer", "train", "experiments/configs/smollm2_stdlib.yaml",
           "--run-dir", str(d), "steps=8", arm, "optimizer.lr=1e-4", "logging.every=1", "checkpoint.every=100",
           "eval.at_end=false"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    rss = int(next(l.split()[1] for l in p.stdout.splitlines() if l.startswith("MAXRSS_KB")))
    rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][2:]  # steps 3-8: compile excluded
    tps.sort()
    out[name] = {"peak_rss_gib": rss / 2**20, "tokens_per_s_median": tps[len(tps) // 2], "rc": p.returncode}
    print(name, out[name], flush=True)
json.dump(out, open("/tmp/peak.json", "w"), indent=1)
