"""The CLI as a new user meets it (docs/cli.md): every user mistake ends in one or two lines that
name the problem and the fix, with a non-zero exit status; the traceback only with --debug.

The commands run on real files through `main(argv)`, the function the `causal-adapter` console script calls, in
this process (`cli`): its stdout and stderr are read at the file descriptors, with the warnings Python would
print, so a stray line still breaks the one-or-two-line rule. A launch costs 2-5 s of imports (CHANGELOG.md: 40 of
them were a third of the suite's launch time), so a real process runs only where only a process shows it: stderr
or stdin on a terminal (a pty), the hub variables read at import time, and one `--help` of the installed module.
The error paths stop before any model is built where they can; none trains more than one step of the tiny base."""
import io
import json
import os
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from causal_adapter.saving.artifacts import WEIGHTS_NAME

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, env=None, stdin=subprocess.DEVNULL, timeout=180):
    """Run `python -m causal_adapter ARGS` (this checkout) in a new process -> (returncode, stdout, stderr, seconds)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    for k, v in list(full_env.items()):
        if v is None:
            del full_env[k]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "causal_adapter.commands.main", *map(str, args)], env=full_env,
                       stdin=stdin, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr, time.perf_counter() - t0


#: warnings a fresh interpreter does not print (Python's default filters), unless raised in __main__
_SILENT_BY_DEFAULT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


@pytest.fixture
def cli(capfd, monkeypatch):
    """`cli(*ARGS, cwd=, env=, umask=)` -> (returncode, stdout, stderr): `causal-adapter ARGS` in this process,
    through the console script's `main`. stderr holds what the file descriptors got (progress bars, logging) and
    the warnings a fresh interpreter would print, formatted as it prints them."""
    from causal_adapter.commands.main import main

    def run(*args, cwd=None, env=None, umask=None):
        if cwd is not None:
            monkeypatch.chdir(cwd)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v) if v is not None else monkeypatch.delenv(k, raising=False)
        capfd.readouterr()
        previous_umask = os.umask(umask) if umask is not None else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # once per place, as a fresh process
            try:
                rc = main([str(a) for a in args])
            except SystemExit as e:  # argparse: --help (0), a bad flag (2)
                rc = e.code if isinstance(e.code, int) else int(e.code is not None)
            finally:
                if previous_umask is not None:
                    os.umask(previous_umask)
        out, err = capfd.readouterr()
        shown = [w for w in caught if not issubclass(w.category, _SILENT_BY_DEFAULT)]
        err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in shown)
        return rc, out, err

    return run


def run_cli_on_terminal(*args, timeout=180):
    """Like `run_cli` with stderr on a terminal (a pty), as a person sees it -> (returncode, stderr)."""
    import pty

    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "causal_adapter.commands.main", *map(str, args)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=secondary)
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    return proc.wait(timeout=timeout), b"".join(chunks).decode("utf-8", "replace")


def visible(text: str) -> list[str]:
    """The lines a terminal shows (a progress bar redraws its line with \\r)."""
    lines = (line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))
    return [line for line in lines if line.strip()]


def assert_short_error(rc, err, *needles, code=1, max_lines=2):
    lines = visible(err)
    assert rc == code, err[-3000:]
    assert 1 <= len(lines) <= max_lines, err[-3000:]
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return lines


@pytest.fixture(scope="module")
def adapter32(tmp_path_factory, qwen_tokenizer):
    """A real saved adapter for the embedded tiny base with --tiny-hidden-size 32 --tiny-layers 1."""
    from causal_adapter.saving.assets import build_tiny_qwen
    from causal_adapter.model import get_causal_model

    path = tmp_path_factory.mktemp("adapter32") / "adapter"
    get_causal_model(build_tiny_qwen("qwen2", hidden_size=32, num_layers=1), tokenizer=qwen_tokenizer) \
        .save_pretrained(path)
    return path


TINY32 = ("--tiny-hidden-size", "32", "--tiny-layers", "1")


# --------------------------------------------------------------------------- base model
@pytest.mark.parametrize("command", ["demo", "train", "verify"])
def test_missing_base_folder_says_so_and_leaves_nothing(tmp_path, cli, command):
    out = tmp_path / "out"
    extra = ["--output-dir", out] if command in ("demo", "train") else []
    rc, _, err = cli(command, "--base", "/tmp/no/such/qwen", *extra)
    lines = assert_short_error(rc, err, "--base '/tmp/no/such/qwen': no such folder", "config.json")
    assert lines[0].startswith(f"causal-adapter {command}: error:")
    assert not out.exists()  # demo/train leave no empty output folder behind


def test_base_folder_without_config(tmp_path, cli):
    rc, _, err = cli("verify", "--base", tmp_path)
    assert_short_error(rc, err, "is a folder without config.json")


@pytest.mark.parametrize("env, needle", [
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    # no network: the hub endpoint refuses connections (nothing leaves the machine)
    ({"HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9"},
     "the hub cannot be reached"),
])
def test_hub_name_without_network_fails_fast(tmp_path, env, needle):
    rc, _, err, seconds = run_cli("generate", "--base", "Qwen/Qwen2.5-0.5B", "hello",
                                  env={"HF_HOME": str(tmp_path / "hf"), **env})
    assert_short_error(rc, err, "--base 'Qwen/Qwen2.5-0.5B' is not a local folder nor in the hub cache", needle)
    assert seconds < 30


# --------------------------------------------------------------------------- data files
def test_broken_jsonl_one_line_and_debug_traceback(tmp_path, cli, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a 1", "completion": " 2"}\n{"prompt": "b 1", "completion": \n')
    out = tmp_path / "run"
    args = ("train", "--train-file", bad, "--output-dir", out, "--max-steps", "1", *TINY32)
    rc, err = run_cli_on_terminal(*args)  # datasets' progress bar, then the error
    lines = assert_short_error(rc, err, "bad.jsonl: line 2: not valid JSON")
    assert lines[-1].startswith("causal-adapter train: error:")
    assert not out.exists()
    # --debug / CAUSAL_ADAPTER_DEBUG=1: main lets the exception through (the interpreter prints its traceback).
    # The file is read before the base loads: the error comes in seconds, not after the model build.
    def base_loaded_first(*_args, **_kwargs):
        raise AssertionError("the base was loaded before the data files were read")

    monkeypatch.setattr("causal_adapter.training.loop.load_base_and_tokenizer", base_loaded_first)
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        cli(*args, "--debug")
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        cli(*args, env={"CAUSAL_ADAPTER_DEBUG": "1"})
    assert not out.exists()


def test_csv_numeric_completions_are_read_as_text(tmp_path, cli, adapter32):
    csv = tmp_path / "num.csv"
    csv.write_text('prompt,completion\nThe value was 1 then,"12.5"\nNext 3 then, 13\nAfter 4 then,14\n')
    rc, out, err = cli("eval", adapter32, *TINY32, "--data-file", csv)
    assert rc == 0, err[-3000:]
    assert "n=3" in out  # three <NUM> targets: quoted and unquoted numbers are all text
    # own column names: the data-column flags of eval
    csv2 = tmp_path / "own.csv"
    csv2.write_text("question,answer\nThe value was 1 then,12.5\n")
    rc, out, err = cli("eval", adapter32, *TINY32, "--data-file", csv2, "--prompt-column", "question",
                              "--completion-column", "answer")
    assert rc == 0 and "n=1" in out, err[-3000:]


def test_jsonl_numeric_completion_and_wrong_columns_name_the_fix(tmp_path, cli, adapter32):
    data = tmp_path / "num.jsonl"
    data.write_text(json.dumps({"prompt": "The value was", "completion": 12.5}) + "\n")
    rc, err = run_cli_on_terminal("eval", adapter32, *TINY32, "--data-file", data)
    assert_short_error(rc, err, "column 'completion' must be a string, got float", "JSON string")
    body = tmp_path / "body.jsonl"
    body.write_text(json.dumps({"body": "The value was 12.5 then 13"}) + "\n")
    rc, _, err = cli("eval", adapter32, *TINY32, "--data-file", body)
    assert_short_error(rc, err, "columns present: ['body']", "--text-column")
    rc, out, err = cli("eval", adapter32, *TINY32, "--data-file", body, "--text-column", "body")
    assert rc == 0, err[-3000:]


# --------------------------------------------------------------------------- adapters
def test_adapter_file_instead_of_directory(cli, adapter32):
    rc, _, err = cli("eval", adapter32 / WEIGHTS_NAME, *TINY32)
    assert_short_error(rc, err, "is a file", f"give {str(adapter32)!r}")
    assert "does not exist" not in err


def test_adapter_of_another_tiny_size_names_the_flag(cli, adapter32):
    rc, _, err = cli("eval", "--adapter", adapter32)
    assert_short_error(rc, err, "hidden_size=32", "pass --tiny-hidden-size 32")
    rc, _, err = cli("eval")
    assert_short_error(rc, err, "give the adapter directory once")
    rc, _, err = cli("generate", "--adapter", adapter32, "The price was 99.9 and", "--max-new-tokens", "1")
    assert_short_error(rc, err, "pass --tiny-hidden-size 32")
    rc, out, err = cli("generate", "--adapter", adapter32, *TINY32, "The price was 99.9 and",
                              "--max-new-tokens", "1")
    assert rc == 0 and out.startswith("The price was 99.9 and"), err[-3000:]


# --------------------------------------------------------------------------- flags
@pytest.mark.parametrize("args, needles", [
    (["train", "--max-stpes", "3"], ["unrecognized arguments: --max-stpes", "did you mean --max-steps?"]),
    (["train", "--max-step", "3"], ["unrecognized arguments: --max-step", "did you mean --max-steps?"]),
    (["demo", "--step", "10"], ["unrecognized arguments: --step", "did you mean --steps?"]),
    (["eval", "x", "--batch", "3"], ["unrecognized arguments: --batch", "did you mean --batch-size?"]),
    (["train", "--max-steps", "abc"], ["argument --max-steps", "invalid int value: 'abc'"]),
    (["train", "--max-steps", "0", "--num-train-epochs", "0"], ["give num_train_epochs > 0 or max_steps > 0"]),
])
def test_bad_flags_two_lines_no_abbreviations(tmp_path, cli, args, needles):
    rc, out, err = cli(*args, cwd=tmp_path)
    assert_short_error(rc, err, *needles, code=2)
    assert not list(tmp_path.iterdir())  # nothing ran


def test_one_flag_vocabulary_across_commands(cli):
    """Also the help of every command (`--help` exits 0 with a usage line; was tests/test_cli.py::
    test_help_of_every_command), and once in a fresh process: the module the console script runs."""
    rc, out, err, _ = run_cli("train", "--help")
    assert rc == 0 and out.startswith("usage: causal-adapter train") and not err, err[-500:]
    for cmd in ("demo", "eval", "generate", "predict", "verify", "train"):
        rc, out, err = cli(cmd, "--help")
        assert rc == 0 and "usage:" in out, (cmd, err[-500:])
        for flag in ("--base", "--tiny-arch", "--tiny-hidden-size", "--tiny-layers", "--debug"):
            assert flag in out, (cmd, flag)
        if cmd in ("eval", "predict", "train"):
            for flag in ("--text-column", "--prompt-column", "--completion-column"):
                assert flag in out, (cmd, flag)
        if cmd in ("demo", "train"):
            assert "--overwrite" in out
    rc, out, _ = cli("data", "--help")
    assert rc == 0 and out.startswith("usage: causal-adapter data")


# --------------------------------------------------------------------------- outputs
def test_demo_and_train_refuse_to_overwrite_a_previous_run(tmp_path, cli):
    demo = tmp_path / "demo"
    (demo / "train" / "adapter").mkdir(parents=True)
    (demo / "demo_metrics.json").write_text('{"steps": 300}\n')
    rc, _, err = cli("demo", "--output-dir", demo)
    assert_short_error(rc, err, "already holds the outputs of a previous run", "--overwrite")
    assert (demo / "demo_metrics.json").read_text() == '{"steps": 300}\n'

    run = tmp_path / "run"
    (run / "checkpoint-99").mkdir(parents=True)
    (run / "checkpoint-99" / "trainer_state.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 99}\n')
    args = ("train", "--output-dir", run, *TINY32, "--max-steps", "1", "--per-device-train-batch-size", "2",
            "--max-eval-samples", "2", "--no-plot", "--no-progress")
    rc, _, err = cli(*args)
    assert_short_error(rc, err, "already holds the outputs", "--overwrite", "--resume-from-checkpoint latest")
    assert (run / "metrics.jsonl").read_text() == '{"step": 99}\n'
    # --overwrite: one real step; the stale checkpoint is gone; files get the umask's permissions
    rc, out, err = cli(*args, "--overwrite", umask=0o022)
    assert rc == 0, err[-3000:]
    assert not (run / "checkpoint-99").exists() and "steps: 1" in out
    for f in (run / "adapter").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_generate_without_prompt_does_not_wait(tmp_path, cli, monkeypatch):
    import pty

    primary, secondary = pty.openpty()  # a terminal on stdin: nothing is piped in
    try:
        rc, _, err, seconds = run_cli("generate", stdin=secondary, timeout=60)
    finally:
        os.close(primary)
        os.close(secondary)
    assert_short_error(rc, err, "no prompt", "causal-adapter generate \"The price was\"")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # stdin empty (as /dev/null)
    rc, _, err = cli("generate")
    assert_short_error(rc, err, "no prompt: stdin was empty")


def test_written_files_get_the_umask_permissions(tmp_path, cli):
    rc, _, err = cli("data", "nile", tmp_path / "c", umask=0o027)
    assert rc == 0, err
    files = sorted((tmp_path / "c").iterdir())
    assert len(files) == 3
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f


# --------------------------------------------------------------------------- train parser
def test_train_config_parses_with_the_real_hf_argument_parser(tmp_path):
    import dataclasses

    from transformers import HfArgumentParser

    from causal_adapter.training.config import TrainConfig
    from causal_adapter.commands.train import build_arg_parser, parse_train_args

    (cfg,) = HfArgumentParser(TrainConfig).parse_args_into_dataclasses(
        ["--train_file", "a.jsonl", "b.jsonl", "--freeze", "cls_bias", "--no_plot", "--lora"], look_for_args_file=False)
    assert cfg.train_file == ["a.jsonl", "b.jsonl"] and cfg.freeze == ["cls_bias"] and not cfg.plot and cfg.lora
    (tmp_path / "c.json").write_text(json.dumps({"max_steps": 7, "report_to": ["tensorboard"]}))
    (tmp_path / "c.yaml").write_text("max_steps: 9\nlora_target_modules: [q_proj, v_proj]\n")
    (cfg,) = HfArgumentParser(TrainConfig).parse_json_file(tmp_path / "c.json")
    assert cfg.max_steps == 7 and cfg.report_to == ["tensorboard"]
    (cfg,) = HfArgumentParser(TrainConfig).parse_yaml_file(tmp_path / "c.yaml")
    assert cfg.max_steps == 9 and cfg.lora_target_modules == ["q_proj", "v_proj"]

    # the train command's parser IS an HfArgumentParser over TrainConfig: one flag per field, generated
    ap = build_arg_parser()
    assert isinstance(ap, HfArgumentParser) and ap.allow_abbrev is False
    assert {f.name for f in dataclasses.fields(TrainConfig)} <= {a.dest for a in ap._actions}
    for flag in ("--base", "--base-model", "--base_model"):
        assert parse_train_args([flag, "/models/qwen"])[0].base_model == "/models/qwen"
    cfg, extras = parse_train_args(["--no-lora", "--no-plot", "--report-to", "tensorboard", "--overwrite"])
    assert not cfg.lora and not cfg.plot and cfg.report_to == ["tensorboard"] and extras.overwrite
    with pytest.raises(SystemExit):
        ap.parse_args(["--max-step", "3"])  # no abbreviations


def test_train_config_file_and_command_line_overrides(tmp_path, cli):
    from causal_adapter.commands.train import parse_train_args

    js = tmp_path / "run.json"
    js.write_text(json.dumps({"max_steps": 7, "learning-rate": 0.05, "train_file": "a.jsonl", "lora": True}))
    cfg, _ = parse_train_args(["--config", str(js), "--max-steps", "3"])
    assert (cfg.max_steps, cfg.learning_rate, cfg.train_file, cfg.lora) == (3, 0.05, ["a.jsonl"], True)
    ym = tmp_path / "run.yaml"
    ym.write_text("max_steps: 9\nlearning_rate: 1.0e-3\nfreeze: [cls_bias]\nplot: false\n")
    cfg, _ = parse_train_args(["--config", str(ym), "--plot"])
    assert (cfg.max_steps, cfg.learning_rate, cfg.freeze, cfg.plot) == (9, 1e-3, ["cls_bias"], True)
    (tmp_path / "typo.yaml").write_text("max_stpes: 9\n")
    with pytest.raises(ValueError, match=r"unknown keys \['max_stpes'\]"):
        parse_train_args(["--config", str(tmp_path / "typo.yaml")])
    (tmp_path / "bad.yaml").write_text("max_steps: 9\n  lora: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        parse_train_args(["--config", str(tmp_path / "bad.yaml")])
    (tmp_path / "bad.json").write_text('{"max_steps": 9,\n}')
    rc, _, err = cli("train", "--config", tmp_path / "bad.json")
    assert_short_error(rc, err, "bad.json': line 2: not valid JSON", code=2)
    rc, _, err = cli("train", "--config", tmp_path / "missing.yaml")
    assert_short_error(rc, err, "missing.yaml': no such file", code=2)
