"""Stress harness for the multi-process launches CI makes (docs/distributed.md, "Exit"); not part of CI.

Repeats, N rounds, the 2-process gloo launches of the test suite, each as the tests start it:

* ``fsdp2``   tests/test_fsdp_train.py's pair: ``--job first`` (ends in its own SIGKILL) then ``--job resume``
* ``fsdp1``   the same with the FSDP1 config
* ``zero3``   tests/test_deepspeed_train.py's ZeRO-3 pair (needs the ``deepspeed`` extra)
* ``ddp``     tests/test_train.py's DDP script under examples/accelerate_configs/cpu_ddp.yaml

The workers end with ``os._exit(0)`` (tests/fsdp_train_worker.py; the DDP script too, since CI's run in which its
rank 1 aborted at exit): every kind counts the aborts during a run.

with or without a CPU load beside them (a process running 2-thread float32 matmuls). Every worker gets
``tools/abort_backtrace.c`` preloaded (built here with gcc) and ``PYTHONFAULTHANDLER=1``: a worker that aborts
prints its Python stacks, its native frames and the names of its threads. A launch counts as an abort when a
worker died of SIGABRT (exit code -6) or printed "terminate called"; its whole output (both ranks: the launcher
relays them) is kept under ``OUT/failures/``. The tally goes to ``OUT/summary.json`` after every launch.

    python tools/launch_stress.py --kinds fsdp2 --rounds 100 --load on --out runs/stress
    python tools/launch_stress.py --kinds fsdp2 zero3 ddp --rounds 20 --load alternate --out runs/stress
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

ABORT_MARKS = ("SIGABRT", "exitcode: -6", "terminate called", "Fatal Python error")
LOAD_SCRIPT = ("import torch\ntorch.set_num_threads(2)\na = torch.randn(768, 768)\n"
               "while True:\n    a = (a @ a).tanh_()\n")


def build_preload(out: Path) -> Path:
    lib = out / "abort_backtrace.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(REPO / "tools" / "abort_backtrace.c")],
                   check=True)
    return lib


def launch_env(preload: Path) -> dict:
    return {"LD_PRELOAD": str(preload), "PYTHONFAULTHANDLER": "1"}


def fsdp_pair(version: int, work: Path, env: dict) -> list[tuple[str, subprocess.CompletedProcess]]:
    from test_fsdp_train import cpu_config, launch

    config = cpu_config(work, version)
    env = {"ACCELERATE_USE_CPU": "1", **env}
    first = launch(config, work, "first", env=env)
    if first.returncode != 0 and "SIGKILL" not in first.stderr:
        return [("first", first)]
    return [("first", first), ("resume", launch(config, work, "resume", env=env))]


def zero3_pair(work: Path, env: dict) -> list[tuple[str, subprocess.CompletedProcess]]:
    from test_deepspeed_train import WORKER, cpu_config
    from test_fsdp_train import launch

    config, env = cpu_config(3, work), {"DS_ACCELERATOR": "cpu", **env}
    first = launch(config, work, "first", timeout=400, worker=WORKER, env=env)
    if first.returncode != 0 and "SIGKILL" not in first.stderr:
        return [("first", first)]
    return [("first", first), ("resume", launch(config, work, "resume", timeout=400, worker=WORKER, env=env))]


def ddp_run(work: Path, env: dict) -> list[tuple[str, subprocess.CompletedProcess]]:
    from test_train import DDP_SCRIPT, free_port

    script = work / "ddp_script.py"
    script.write_text(DDP_SCRIPT)
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", **env}
    full_env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "examples/accelerate_configs/cpu_ddp.yaml"), "--main_process_port", str(free_port()),
           str(script), str(work / "out"), "4", "2"]
    return [("run", subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=400, cwd=str(work)))]


KINDS = {"fsdp2": lambda w, e: fsdp_pair(2, w, e), "fsdp1": lambda w, e: fsdp_pair(1, w, e),
         "zero3": zero3_pair, "ddp": ddp_run}


def verdict(job: str, proc: subprocess.CompletedProcess) -> str:
    """'ok', 'abort' (a worker's SIGABRT / std::terminate) or 'fail' (anything else unexpected)."""
    text = proc.stdout + proc.stderr
    if any(mark in text for mark in ABORT_MARKS):
        return "abort"
    expected_kill = job == "first"
    if expected_kill:
        return "ok" if proc.returncode != 0 and "SIGKILL" in proc.stderr else "fail"
    return "ok" if proc.returncode == 0 else "fail"


def start_load() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=["fsdp2"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--load", choices=["off", "on", "alternate"], default="on",
                    help="a 2-thread matmul process beside the launches: never, always, every other round")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "launch_stress")
    ap.add_argument("--stop-at-first-abort", action="store_true")
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    env = launch_env(build_preload(args.out))
    tally: dict = {"launches": 0, "aborts": 0, "other_failures": 0, "by": {}, "failures": []}
    t0 = time.time()
    for rnd in range(args.rounds):
        loaded = args.load == "on" or (args.load == "alternate" and rnd % 2 == 1)
        load = start_load() if loaded else None
        try:
            for kind in args.kinds:
                work = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=args.out))
                try:
                    results = KINDS[kind](work, env)
                except subprocess.TimeoutExpired as e:
                    results = [("timeout", subprocess.CompletedProcess(e.cmd, -9, str(e.stdout or ""),
                                                                        str(e.stderr or "") + "\nTIMEOUT"))]
                for job, proc in results:
                    v = "fail" if job == "timeout" else verdict(job, proc)
                    key = f"{kind}/{job}/{'load' if loaded else 'idle'}"
                    by = tally["by"].setdefault(key, {"launches": 0, "aborts": 0, "fail": 0})
                    by["launches"] += 1
                    tally["launches"] += 1
                    if v != "ok":
                        by["aborts" if v == "abort" else "fail"] += 1
                        tally["aborts" if v == "abort" else "other_failures"] += 1
                        keep = args.out / "failures" / f"{tally['launches']:04d}-{kind}-{job}-{v}"
                        keep.mkdir(parents=True, exist_ok=True)
                        (keep / "stdout.txt").write_text(proc.stdout)
                        (keep / "stderr.txt").write_text(proc.stderr)
                        (keep / "returncode").write_text(str(proc.returncode))
                        tally["failures"].append(str(keep))
                    print(f"[{time.time() - t0:7.0f}s] round {rnd + 1}/{args.rounds} {key}: {v} (rc "
                          f"{proc.returncode}) | launches {tally['launches']} aborts {tally['aborts']} "
                          f"other {tally['other_failures']}", flush=True)
                shutil.rmtree(work, ignore_errors=True)
                (args.out / "summary.json").write_text(json.dumps({**tally, "seconds": round(time.time() - t0)},
                                                                  indent=1))
                if args.stop_at_first_abort and tally["aborts"]:
                    return
        finally:
            if load is not None:
                os.killpg(load.pid, 9)
                load.wait()


if __name__ == "__main__":
    main()
