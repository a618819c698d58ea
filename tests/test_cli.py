"""The command line: a pulse test (2-layer model, 3 steps through `jaxformer train`), eval, info, generate, errors."""

from __future__ import annotations

import json
import math
import re

import pytest

from jaxformer.cli import main
from jaxformer.train.metrics import read_metrics
from tests.train.helpers import tiny_raw, write_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`jaxformer train` on the embedded stdlib corpus: 2 layers, 3 steps."""
    tmp = tmp_path_factory.mktemp("cli")
    raw = tiny_raw(tmp, steps=3, data={"source": "stdlib", "path": None, "val_fraction": 0.02},
                   eval={"max_tokens": 512, "final_max_tokens": 1024, "at_end": True, "compare_compressors": True,
                         "sample": {"prompt": "def ", "max_new_tokens": 8}},
                   logging={"every": 1, "progress": True, "tensorboard": True})
    cfg = write_config(tmp / "pulse.yaml", raw)
    run = tmp / "run"
    return cfg, run, main(["train", str(cfg), "--run-dir", str(run), "--steps", "3", "checkpoint.keep=4"])


def test_pulse(trained, capsys):
    cfg, run, code = trained
    assert code == 0
    rows = read_metrics(run)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for r in train_rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "param_norm"} <= set(r)
    # an untrained model predicts ~uniformly: loss ~ ln V at step 1 (measured 5.58 vs ln 264 = 5.576);
    # 3 steps at lr 3e-3 move it by < 0.1 but do move it
    losses = [r["loss"] for r in train_rows]
    assert abs(losses[0] - math.log(264)) < 0.05 and len(set(losses)) == 3 and max(losses) < math.log(264) + 0.1
    from jaxformer.train import config as C
    from jaxformer.train.optim import make_schedule
    c = C.load(run / "config.yaml")
    lr = make_schedule(c.optimizer, c.schedule, c.steps)
    for r in train_rows:  # the row of step s reports the learning rate that step s used
        assert r["lr"] == pytest.approx(float(lr(r["step"] - 1)), rel=1e-6)
        assert 0 < r["grad_norm"] < 100 and r["param_norm"] > 0
    ev = [r for r in rows if "val_loss" in r]
    assert ev and {"step", "val_loss", "val_bpb", "gzip9_bpb", "xz9e_bpb"} <= set(ev[-1])
    assert (run / "config.yaml").exists() and "keep: 4" in (run / "config.yaml").read_text()
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]


def test_eval_info_generate(trained, capsys):
    _, run, _ = trained
    capsys.readouterr()
    assert main(["eval", str(run), "--max-tokens", "256", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 3 and out["val_tokens"] > 200 and out["val_bpb"] > 0
    assert main(["eval", str(run), "--max-tokens", "256"]) == 0  # readable by default, as train's summary is
    assert capsys.readouterr().out == (f"eval: step 3 · val loss {out['val_loss']:.4f} over {out['val_tokens']:,} "
                                       f"tokens · val {out['val_bpb']:.4f} bits/byte over "
                                       f"{out['val_bytes']:,} bytes\n")
    for bad in ("0", "-5"):  # scored one window, reported as a result; -1 (the default) alone is a sentinel
        assert main(["eval", str(run), "--max-tokens", bad]) == 2
        assert f"eval: --max-tokens {bad} must be >= 1 (or --all" in capsys.readouterr().err
    assert main(["generate", str(run), "--prompt", "import ", "--max-new-tokens", "5", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("import ")
    assert main(["info", "llama_tiny"]) == 0
    info = capsys.readouterr().out
    assert "parameters" in info and "FLOPs/token" in info and "memory per device" in info


def test_generate_prompts_file_writes_one_json_line_per_request(trained, tmp_path, capsys):
    """Many prompts through the engine; a bad request fails alone, the others complete."""
    _, run, _ = trained
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('def \n{"prompt": "class ", "temperature": 0.0, "max_new_tokens": 3}\n'
                       '{"prompt": "import ", "top_p": 7.0}\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    code = main(["generate", str(run), "--prompts-file", str(prompts), "--output", str(out),
                 "--max-new-tokens", "4", "--max-batch", "2"])
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert code == 1  # one request was invalid
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert rows[0]["error"] is None and 0 < len(rows[0]["tokens"]) <= 4
    assert rows[1]["error"] is None and len(rows[1]["tokens"]) <= 3 and rows[1]["prompt"] == "class "
    assert rows[2]["error"] and "top_p" in rows[2]["error"]
    # --output with --prompt alone writes its JSON line there too (it was ignored, the text on stdout)
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "class ", "--output", str(out), "--max-new-tokens", "3",
                 "--temperature", "0", "--max-batch", "2"]) == 0
    (row,) = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert row["prompt"] == "class " and row["tokens"] == rows[1]["tokens"] and capsys.readouterr().out == ""


def test_a_text_folder_of_one_file_trains_with_a_validation_split_and_evaluates(tmp_path, capsys):
    """The README's fine-tune recipe on a one-file folder: validation is the text's tail, the start line
    says so, training evaluates at the end, and `jaxformer eval RUN` works."""
    (tmp_path / "texts").mkdir()
    text = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200))
    (tmp_path / "texts" / "notes.txt").write_text(text)
    raw = tiny_raw(tmp_path / "texts", steps=2, data={"val_fraction": 0.02}, eval={"at_end": True})
    run = tmp_path / "run"
    assert main(["train", str(write_config(tmp_path / "one.yaml", raw)), "--run-dir", str(run)]) == 0
    start = capsys.readouterr().out.splitlines()[0]
    n_val = round(0.02 * len(text))
    assert start.endswith(f" · validation: the last {n_val} of {len(text):,} bytes of the text (the file-level split "
                          "at data.val_fraction=0.02 held out nothing)"), start
    final = [r for r in read_metrics(run) if r.get("final")]
    assert len(final) == 1 and final[0]["val_bytes"] == n_val  # every validation byte scored
    assert main(["eval", str(run)]) == 0
    assert capsys.readouterr().out.startswith(f"eval: step 2 · val loss {final[0]['val_loss']:.4f}")


def test_info_on_a_config_uses_its_mesh(tmp_path, capsys):
    raw = tiny_raw(tmp_path, mesh={"data": 2, "fsdp": 2, "tensor": 2})
    cfg = write_config(tmp_path / "c.yaml", raw)
    assert main(["info", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "data=2 fsdp=2 tensor=2" in out and "batch/device 2" in out


def test_info_compile_shows_xlas_memory_analysis_beside_the_estimate(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", tiny_raw(tmp_path, mesh={"data": 1}))
    assert main(["info", "--compile", str(cfg), "--devices", "2", "mesh.data=-1"]) == 2
    assert "--compile compiles on the 8 devices present (mesh data=8 " in capsys.readouterr().err
    assert main(["info", "--compile", str(cfg), "--devices", "1", "model.n_layers=1"]) == 0  # intermixed
    out = capsys.readouterr().out
    assert "memory per device (estimate):" in out and "memory per device (XLA, the compiled train step on cpu):" in out
    assert "arguments" in out and "temporaries" in out and "peak" in out


def test_config_errors_exit_2_naming_file_and_key(tmp_path, capsys):
    raw = tiny_raw(tmp_path)
    raw["optimizer"]["lr"] = "fast"
    cfg = write_config(tmp_path / "bad.yaml", raw)
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}: optimizer.lr: Input should be a valid number" in err
    assert main(["train", str(write_config(tmp_path / "ok.yaml", tiny_raw(tmp_path))), "model.n_layerz=1"]) == 2
    assert "model.n_layerz: unknown key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", str(cfg), "--bogus-flag"])
    assert main(["eval", str(tmp_path / "nowhere")]) == 2


def _memory(out: str, row: str) -> float:
    """GiB in the `memory per device` row named ``row`` of `jaxformer info`'s output."""
    value, unit = re.search(rf"^\s+{row}\s+([\d,.]+) (MiB|GiB)$", out, re.MULTILINE).groups()
    return float(value.replace(",", "")) / (1024 if unit == "MiB" else 1)


@pytest.mark.slow  # 11 s (llama_7b traced three times); tests/train/test_info.py's fsdp / devices-alone tests plan the
# same numbers, test_info_on_a_config_plans_devices_and_overrides prints a planned mesh: default-run tests
def test_info_plans_a_preset_on_devices_with_a_mesh(capsys):
    assert main(["info", "llama_7b", "--devices", "1"]) == 0
    one = capsys.readouterr().out
    assert main(["info", "llama_7b", "--devices", "8", "mesh.fsdp=8"]) == 0
    fsdp = capsys.readouterr().out
    assert "data=1 fsdp=1 tensor=1  batch/device 1  (batch_size 1)" in one
    assert "data=1 fsdp=8 tensor=1  batch/device 1  (batch_size 8)" in fsdp
    assert _memory(one, "parameters") == pytest.approx(25.10, abs=0.01)  # 6.74e9 fp32
    for row in ("parameters", "gradients", "adamw state"):
        assert _memory(fsdp, row) == pytest.approx(_memory(one, row) / 8, rel=0.01)
    assert _memory(fsdp, "activations") == _memory(one, "activations")
    assert main(["info", "llama_7b", "--devices", "8"]) == 0  # default mesh: data takes every device
    assert "data=8 fsdp=1 tensor=1  batch/device 1  (batch_size 8)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["mesh.data=2", "mesh.fsdp=8"], "mesh data=2 fsdp=8 tensor=1 needs 16 devices, --devices 8"),
    pytest.param(["mesh.fsdp=8", "batch_size=4"], "batch_size=4 not divisible by data*fsdp=8 on mesh data=1 fsdp=8 "
                 "tensor=1", marks=pytest.mark.slow),  # 3 s (llama_7b traced first): this refusal through `info`
    # (test_info_on_a_config_plans_devices_and_overrides) and the message (tests/train/test_info.py) run by default
    (["model.mesh.fsdp=8"], "llama_7b: model.mesh: unknown key"),
])
def test_info_refuses_impossible_layouts(argv, message, capsys):
    assert main(["info", "llama_7b", "--devices", "8", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"jaxformer info: error: {message}")


def test_info_on_a_config_plans_devices_and_overrides(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", tiny_raw(tmp_path))  # batch_size 8, mesh data=1
    assert main(["info", str(cfg), "--devices", "8"]) == 2
    assert "mesh data=1 fsdp=1 tensor=1 needs 1 device, --devices 8" in capsys.readouterr().err
    assert main(["info", str(cfg), "--devices", "8", "mesh.data=-1"]) == 0
    assert "data=8 fsdp=1 tensor=1  batch/device 1  (batch_size 8)" in capsys.readouterr().out
    assert main(["info", str(cfg), "--devices", "16", "mesh.data=-1"]) == 2
    assert "batch_size=8 not divisible by data*fsdp=16" in capsys.readouterr().err


def test_info_on_an_unknown_target_names_the_closest_presets(tmp_path, capsys):
    assert main(["info", "llama7b"]) == 2
    err = capsys.readouterr().err
    assert err == "jaxformer info: error: no such file or preset: 'llama7b'; closest presets: llama_7b, llama3_1b\n"
    assert main(["info", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"no such file or preset: '{tmp_path / 'nope.yaml'}'; presets: vaswani_base, gpt2_small" in err


@pytest.mark.parametrize("argv", [
    ["info", "llama_7b", "optimizer.lr"],
    ["info", "llama_7b", "--devices", "8", "optimizer.lr"],
    ["info", "CFG", "optimizer.lr"],
    ["train", "CFG", "optimizer.lr", "--run-dir", "RUN"],
    ["train", "CFG", "--run-dir", "RUN", "--steps", "1", "optimizer.lr"],  # after an option: argparse's extras
])
def test_override_without_equals_says_key_sub_value(argv, tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", tiny_raw(tmp_path))
    argv = [str(cfg) if a == "CFG" else str(tmp_path / "run") if a == "RUN" else a for a in argv]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"jaxformer {argv[0]}: error: override 'optimizer.lr' is not key.sub=value "
                                       "(e.g. optimizer.lr=3e-4)\n")
    assert not (tmp_path / "run").exists()  # refused before any work


def test_generate_says_when_the_context_cut_a_completion_and_separates_completions(trained, tmp_path, capsys):
    """Context 32: 40 new tokens are cut, with a note per prompt on stderr; two prompts print under
    separator lines; --window 32 goes on past the context and says so once; --window 33 is refused."""
    _, run, _ = trained
    capsys.readouterr()
    args = ["generate", str(run), "--max-new-tokens", "40", "--temperature", "0"]
    assert main([*args, "--prompt", "def ", "--prompt", "import os"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("----- completion 1 of 2 -----\ndef ")
    assert "\n----- completion 2 of 2 -----\nimport os" in out
    for i in (1, 2):
        assert (f"note: prompt {i} stopped at the model's 32-token context after " in err
                and "new tokens; pass --window N (N <= 32) to continue with a sliding window" in err), err

    prompts = tmp_path / "p.txt"
    prompts.write_text("def \n", encoding="utf-8")
    rows = {}
    for window in (None, 32):
        out_path = tmp_path / f"w{window}.jsonl"
        extra = [] if window is None else ["--window", str(window)]
        assert main([*args, "--prompts-file", str(prompts), "--output", str(out_path), *extra]) == 0
        rows[window] = json.loads(out_path.read_text(encoding="utf-8"))
        err = capsys.readouterr().err
        if window is None:
            cut = rows[None]
            assert cut["stopped_by"] == "context" and cut["finish_reason"] == "length"
            assert len(cut["tokens"]) == 32 - cut["num_prompt_tokens"] + 1
            assert (f"note: request index=0 stopped at the model's 32-token context after {len(cut['tokens'])} "
                    "new tokens") in err
        else:
            assert err.count("note: generated past the model's 32-token context with a sliding 32-token window") == 1
            assert "stopped at" not in err
    # a window that generation never needs is not mentioned: 5 tokens stay inside the 32-token context
    assert main([*args[:2], "--max-new-tokens", "5", "--prompt", "def ", "--window", "32"]) == 0
    assert capsys.readouterr().err == ""
    assert rows[32]["stopped_by"] == "max_new_tokens" and len(rows[32]["tokens"]) == 40
    assert rows[32]["tokens"][: len(rows[None]["tokens"])] == rows[None]["tokens"]

    assert main([*args, "--prompt", "def ", "--window", "33"]) == 2
    assert "window=33 must be an int in [1, max_seq_len=32]" in capsys.readouterr().err


def test_a_prompt_longer_than_the_context_is_a_usage_error(trained, capsys):
    """Exit 2 and `jaxformer generate: error:`, as every other usage error; with several prompts, which one."""
    _, run, _ = trained
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "x" * 40]) == 2
    assert capsys.readouterr().err == ("jaxformer generate: error: prompt of 41 tokens is longer than the model's "
                                       "context max_seq_len=32\n")
    assert main(["generate", str(run), "--prompt", "def ", "--prompt", "x" * 40, "--max-new-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("----- completion 1 of 2 -----\ndef ")
    assert err == ("jaxformer generate: error: prompt 2: prompt of 41 tokens is longer than the model's context "
                   "max_seq_len=32\n")


def test_config_errors_say_where_the_mistake_is_and_what_was_meant(trained, tmp_path, capsys):
    """A typo in an override is the command line's, not the file's; an unknown key gets the closest known
    one; a missing run directory says so; `info RUN_DIR` plans the run's own config."""
    cfg, run, _ = trained
    capsys.readouterr()
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "r"), "model.dmodel=64"]) == 2
    assert capsys.readouterr().err == ("jaxformer train: error: override 'model.dmodel=64': model.dmodel: unknown key; "
                                       "did you mean model.d_model?\n")
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "r"), "optimizer.lr=fast"]) == 2
    err = capsys.readouterr().err
    assert "error: override 'optimizer.lr=fast': optimizer.lr: Input should be a valid number" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(cfg.read_text().replace("n_layers:", "n_layerz:").replace("seed:", "sed:"))
    assert main(["train", str(bad), "--run-dir", str(tmp_path / "r"), "model.n_heads=4"]) == 2
    assert capsys.readouterr().err == (f"jaxformer train: error: {bad}: model.n_layerz: unknown key; did you mean "
                                       f"model.n_layers?\n{bad}: sed: unknown key; did you mean seed?\n")
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "r"), "model.zzz=1"]) == 2
    assert capsys.readouterr().err == "jaxformer train: error: override 'model.zzz=1': model.zzz: unknown key\n"
    assert not (tmp_path / "r").exists()

    for command in (["eval"], ["generate", "--prompt", "def "], ["export", "--hf", str(tmp_path / "out")]):
        assert main([command[0], str(tmp_path / "nope"), *command[1:]]) == 2
        assert capsys.readouterr().err == f"jaxformer {command[0]}: error: no such run directory: {tmp_path / 'nope'}\n"
    assert main(["eval", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"jaxformer eval: error: {tmp_path} is not a run directory (no config.yaml)\n"

    assert main(["info", str(run), "--devices", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{run}\n") and "parameters" in out and "data=1 fsdp=1 tensor=1" in out
    assert main(["info", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"jaxformer info: error: {tmp_path} is not a run directory (no config.yaml)\n"
