"""The command line: a pulse test (2-layer model, 3 steps through `jaxformer train`), eval, info, generate, errors."""

from __future__ import annotations

import json

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
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(r) and r["loss"] > 0
    ev = [r for r in rows if "val_loss" in r]
    assert ev and {"step", "val_loss", "val_bpb", "gzip9_bpb", "xz9e_bpb"} <= set(ev[-1])
    assert (run / "config.yaml").exists() and "keep: 4" in (run / "config.yaml").read_text()
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]


def test_eval_info_generate(trained, capsys):
    _, run, _ = trained
    capsys.readouterr()
    assert main(["eval", str(run), "--max-tokens", "256"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 3 and out["val_tokens"] > 200 and out["val_bpb"] > 0
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


def test_info_on_a_config_uses_its_mesh(tmp_path, capsys):
    raw = tiny_raw(tmp_path, mesh={"data": 2, "fsdp": 2, "tensor": 2})
    cfg = write_config(tmp_path / "c.yaml", raw)
    assert main(["info", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "data=2 fsdp=2 tensor=2" in out and "batch/device 2" in out


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
