"""The product surface at toy size: the main job end to end, the CLI, the examples."""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from causal_adapter.saving.artifacts import CONFIG_NAME, WEIGHTS_NAME
from causal_adapter.commands.main import main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_end_to_end_at_toy_size(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out), "--steps", "4", "--batch-size", "8"]) == 0
    printed = capsys.readouterr().out
    assert "predictions of the reloaded adapter identical: True" in printed
    adapter = out / "train" / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME, "README.md"])
    assert (out / "train" / "training.png").stat().st_size > 10_000
    table = (out / "demo_metrics.md").read_text()
    for row in ("value MAE (loc_Y)", "<NUM> recall", "coverage of 90% interval", "constant baseline MAE",
                "persistence baseline MAE"):
        assert row in table
    summary = json.loads((out / "demo_metrics.json").read_text())
    assert summary["reload_identical"] is True and summary["steps"] == 4
    assert summary["after"]["loss"] < summary["before"]["loss"]
    # a plain re-run (or an abbreviated flag) does not overwrite this run
    assert main(["demo", "--output-dir", str(out), "--steps", "4"]) == 1
    assert "pass --overwrite to replace them" in capsys.readouterr().err
    assert json.loads((out / "demo_metrics.json").read_text()) == summary
    # the saved adapter evaluates through the eval command with the same value error
    assert main(["eval", str(adapter), "--output", str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["value_mae"] == pytest.approx(summary["after"]["value_mae"], rel=1e-6)
    # yearly sunspot numbers hold zeros in training: the series is nonneg, and a 6-step fan never goes below 0 (issue
    # 66: the playground's fan of the demo's adapter reached -141 from step 3)
    from causal_adapter.model.causal_model import CausalModel
    from causal_adapter.saving.assets import build_tiny_qwen, load_qwen_tokenizer

    model = CausalModel.from_pretrained(build_tiny_qwen("qwen2"), adapter)
    assert [e["support"] for e in model.causal_config.value_series.values()] == ["nonneg"]
    prompt = ("Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971: 66.6; 1972: 68.9; 1973: 38; 1974: 34.5; "
              "1975: 15.5; 1976: 12.6; 1977: 27.5; 1978: 92.5; 1979:")
    fan = model.predict_horizon([prompt], tokenizer=load_qwen_tokenizer(), horizon=6, paths=40, levels=(0.5, 0.9),
                                continuations=[[f"; {1980 + h}:" for h in range(5)]])[0]
    assert fan["support"] == "nonneg" and fan["series"].startswith("Yearly sunspot numbers")
    assert min(min(s["value"], s["lower_90"], s["lower_50"]) for s in fan["horizon"]) >= 0


def test_generate_and_verify_commands(capsys):
    assert main(["verify"]) == 0
    assert "initialization check: PASS" in capsys.readouterr().out
    assert main(["generate", "The price was 99.9 yuan and then", "--max-new-tokens", "3", "--mode", "softmax"]) == 0
    assert capsys.readouterr().out.startswith("The price was 99.9 yuan and then")


def test_data_command_writes_jsonl(tmp_path):
    assert main(["data", "nile", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "nile_test.jsonl").read_text().splitlines()]
    assert rows and {"prompt", "completion", "target", "previous"} <= set(rows[0])


@pytest.mark.parametrize("script, args", [
    ("quickstart.py", []),
    ("generate.py", ["--max-new-tokens", "4"]),
    ("finetune.py", ["--epochs", "0.1"]),
])
def test_examples_run(tmp_path, script, args):
    if script == "finetune.py":
        args = args + ["--output-dir", str(tmp_path / "ft")]
    env = {**os.environ, "MPLBACKEND": "Agg"}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


COMMAND_NAMES = ("demo", "train", "eval", "generate", "predict", "verify")


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("command", COMMAND_NAMES)
def test_help_says_each_default_once(command, capsys):
    text = " ".join(_help(command, capsys).split())  # argparse wraps lines
    assert "(default: None)" not in text
    assert not re.search(r"\(default:[^()]*(\([^()]*\))?[^()]*\) \(default:", text), text


@pytest.mark.parametrize("command", ("demo", "train", "eval", "generate", "predict", "verify"))
def test_one_dtype_vocabulary(command, capsys):
    text = _help(command, capsys)
    assert "float16" in text.replace("bfloat16", "") and "--dtype" in text


def test_one_dataset_flag_with_the_old_spelling_kept():
    from causal_adapter.commands.main import build_parser
    from causal_adapter.commands.train import parse_train_args

    parser = build_parser()
    for flag in ("--dataset", "--corpus"):
        args = parser.parse_args(["eval", "adapter-dir", flag, "nile"])
        assert args.dataset == "nile"
        assert parse_train_args([flag, "nile"])[0].dataset == "nile"
