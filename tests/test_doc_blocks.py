"""The documentation's runnable blocks run (docs/architecture.md, "Runnable documentation"): every ```bash and
```python block of docs/ whose fence follows the line `<!-- runnable -->` runs at toy size, so a renamed flag,
command or function fails here rather than for a reader.

One test per page: its marked blocks run in order in one temporary directory, which starts with the sunspots
corpus in `data/` and a trained toy adapter (the module fixture: 2 steps on the embedded base) at each path of
ADAPTER_AT.
`causal-adapter ...` lines run in-process (`commands.main.main`, a `> FILE` redirect honoured), any other line in
bash; Python blocks run with `exec`. `--max-steps N` and `max_steps=N` are cut to toy size (TOY)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from causal_adapter.commands.main import main

DOCS = Path(__file__).resolve().parents[1] / "docs"
TASKS = Path(__file__).resolve().parent / "data" / "lm_eval"
MARKER = "<!-- runnable -->"
# a block that needs an optional extra names its modules: `<!-- runnable: needs lm_eval -->` (skipped without them)
NEEDS = re.compile(r"<!-- runnable: needs ([\w.]+(?:, *[\w.]+)*) -->")
ADAPTER_AT = ("demo/train/adapter", "chat-run/adapter", "runs/sunspots/adapter")  # where a page's directory holds it
TOY = [(re.compile(r"--max-steps \d+"), "--max-steps 2 --max-train-samples 48 --max-eval-samples 16 --no-plot --no-progress"),
       (re.compile(r"\bmax_steps=\d+"), "max_steps=2")]
OPERATORS = {"|", "||", "&", "&&", ";", "<", ">>", "(", ")"}


def runnable_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line of the fence, language, code) of every marked block; a marker inside a ```` example is text. A block
    whose marker names modules that do not import is left out (`NEEDS`)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i, example = [], 0, False
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("````"):
            example = not example
        elif (line == MARKER or NEEDS.fullmatch(line)) and not example:
            needs = NEEDS.fullmatch(line)
            fence = re.fullmatch(r"```(bash|python)", lines[i + 1].strip()) if i + 1 < len(lines) else None
            assert fence, f"{page.name}:{i + 1}: {MARKER} must be followed by a ```bash or ```python fence"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
            if needs is None or all(importlib.util.find_spec(m) for m in re.split(r", *", needs.group(1))):
                blocks.append((i + 2, fence.group(1), "\n".join(lines[i + 2:end])))
            i = end
        i += 1
    return blocks


PAGES = sorted(p for p in DOCS.rglob("*.md") if runnable_blocks(p))


def toy(code: str) -> str:
    for pattern, small in TOY:
        code = pattern.sub(small, code)
    return code


def shell_lines(code: str) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment-only lines dropped."""
    return [line for line in code.replace("\\\n", " ").splitlines() if line.strip() and not line.lstrip().startswith("#")]


def in_process(line: str) -> tuple[list[str], str | None] | None:
    """(argv, stdout file) of a plain `causal-adapter ...` line (optionally `> FILE`), else None (bash runs it)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.commenters = "#"
    lexer.wordchars += "[]{}:,@%+=~^!"
    try:
        tokens = list(lexer)
    except ValueError:
        return None
    if not tokens or tokens[0] != "causal-adapter" or OPERATORS & set(tokens):
        return None
    if ">" in tokens:
        at = tokens.index(">")
        if at != len(tokens) - 2:
            return None
        return tokens[1:at], tokens[-1]
    return tokens[1:], None


def run_line(line: str, where: str) -> None:
    command = in_process(line)
    if command is None:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        done = subprocess.run(["bash", "-eo", "pipefail", "-c", line], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{where}: `{line}` exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return
    argv, stdout_file = command
    with contextlib.ExitStack() as stack:
        if stdout_file:
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(stdout_file, "w"))))
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's exit on a bad command line
            rc = e.code
    assert rc in (0, None), f"{where}: `{line}` exited {rc} (its error is printed above)"


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory) -> Path:
    """The sunspots corpus in data/ and an adapter trained on it for 2 steps in run/adapter."""
    root = tmp_path_factory.mktemp("toy-run")
    assert main(["data", "sunspots", str(root / "data")]) == 0
    argv = ["train", "--train-file", str(root / "data" / "sunspots_train.jsonl"), "--validation-file",
            str(root / "data" / "sunspots_validation.jsonl"), "--output-dir", str(root / "run"), *toy("--max-steps 2").split()]
    assert main(argv) == 0
    return root


def test_the_marker_convention_finds_blocks_on_the_main_guide_pages():
    names = {p.relative_to(DOCS).as_posix() for p in PAGES}
    assert {"cli.md", "predict.md", "values.md", "chat.md", "decoding.md", "saving.md", "tutorial.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(DOCS).as_posix() for p in PAGES])
def test_runnable_blocks_run(page: Path, toy_run: Path, tmp_path: Path, monkeypatch):
    shutil.copytree(toy_run / "data", tmp_path / "data")
    for rel in ADAPTER_AT:
        shutil.copytree(toy_run / "run" / "adapter", tmp_path / rel)
    shutil.copytree(TASKS, tmp_path / "tests" / "data" / "lm_eval")  # docs/evaluate.md's local lm-eval tasks
    monkeypatch.chdir(tmp_path)
    try:
        for line_no, language, code in runnable_blocks(page):
            where = f"docs/{page.relative_to(DOCS).as_posix()}:{line_no}"
            code = toy(code)
            if language == "python":
                exec(compile(code, where, "exec"), {"__name__": "__doc_block__"})
            else:
                for line in shell_lines(code):
                    run_line(line, where)
    finally:  # a server a block started in the background (its pid in a *.pid file) stops with the page
        for pid_file in tmp_path.glob("*.pid"):
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
