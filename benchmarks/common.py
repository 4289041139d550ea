"""Code the benchmark scripts share (not a benchmark itself; benchmarks/README.md, "Shared code").

Sections: output (`write_report`: the tables, the JSON beside them, the RESULT line last), least squares, the CLI
recipe (`train_and_predict`, `run_arguments`), the random 0.5B-shape base, device helpers (each also runs on CPU).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a server's, a torchrun rendezvous')."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline() -> None:
    """No download at run time: the hub, transformers and datasets offline unless the caller says otherwise."""
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(k, "1")


# ----------------------------------------------------------------------------- output
def log(msg: str) -> None:
    print(msg, flush=True)


def fmt(v, digits=4):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, (bool, int)):
        return str(v)
    return f"{v:.{digits}g}"


def write_report(out: Path, text: str, line: str, seconds: float, summary: dict) -> None:
    """The markdown tables at `out`, `summary` (+ seconds, the RESULT line) as JSON beside it (.json); then the
    tables, where they went, and the RESULT line last on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n", encoding="utf-8")
    summary = {**summary, "seconds": seconds, "result_line": line}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")
    print()
    print(text)
    print(f"\ntables: {out}  json: {out.with_suffix('.json')}  time: {seconds:.0f} s")
    print(line)


# ----------------------------------------------------------------------------- least squares
def ridge_fit(X: torch.Tensor, t: torch.Tensor, lam: float) -> torch.Tensor:
    """w [d + 1] (intercept last, unpenalised) of ridge regression, features standardised inside."""
    mu, sd = X.mean(0), X.std(0).clamp_min(1e-12)
    Xs = (X - mu) / sd
    A = Xs.T @ Xs + lam * len(X) * torch.eye(X.shape[1], dtype=X.dtype)
    w = torch.linalg.solve(A, Xs.T @ (t - t.mean()))
    return torch.cat([w / sd, (t.mean() - (mu / sd) @ w).reshape(1)])


def ridge_predict(w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    return X @ w[:-1] + w[-1]


# ----------------------------------------------------------------------------- the CLI recipe, train then predict
def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def train_and_predict(args, name: str, train_rows: list[dict], val_rows: list[dict], test_rows: list[dict],
                      work: Path, levels=(0.5, 0.9), **predict) -> tuple[list[dict], dict]:
    """Train one adapter on the rows as ``causal-adapter train --train-file T --validation-file V`` does (the
    default TrainConfig: the embedded tiny Qwen and the real tokenizer; `args.tiny`, ``args.steps`` and
    ``args.recent_values`` override), load it back with `CausalModel.from_pretrained` and predict the test rows
    as ``causal-adapter predict ADAPTER --data-file TEST`` does (`predict_files` at `levels`, `predict`: its other
    keywords, e.g. horizon / paths); (prediction rows in test order, run info)."""
    from causal_adapter import CausalModel
    from causal_adapter.commands.predict import predict_files
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import load_base_and_tokenizer, train

    work.mkdir(parents=True, exist_ok=True)
    files = {k: work / f"{name}_{k}.jsonl" for k in ("train", "validation", "test")}
    for k, rows in zip(files, (train_rows, val_rows, test_rows)):
        write_jsonl(files[k], rows)
    recent = getattr(args, "recent_values", None)
    overrides = {**args.tiny, **({} if args.steps is None else {"max_steps": args.steps}),
                 **({} if recent is None else {"recent_values": recent}),
                 **{k: getattr(args, k) for k in ("series_widths", "series_ar") if hasattr(args, k)}}
    # output and display only (no plot file, no progress bar); every training setting is the default
    config = TrainConfig(train_file=[str(files["train"])], validation_file=[str(files["validation"])],
                         output_dir=str(work / f"{name}_run"), plot=False, progress=False, seed=args.seed, **overrides)
    t0 = time.perf_counter()
    result = train(None, config)
    train_seconds = time.perf_counter() - t0
    base, tokenizer = load_base_and_tokenizer(config)  # what `predict` loads with no --base flag
    model = CausalModel.from_pretrained(base, str(result.adapter_dir), tokenizer=tokenizer)
    pred_path = work / f"{name}_pred.jsonl"
    t1 = time.perf_counter()
    counts = predict_files(model, tokenizer, [str(files["test"])], output=str(pred_path), levels=levels,
                           progress=False, **predict)
    predict_seconds = time.perf_counter() - t1
    preds = {}
    for line in pred_path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        preds[r["row"]] = r
    if counts["skipped"] or len(preds) != len(test_rows):
        raise RuntimeError(f"set {name}: predict skipped {counts['skipped']} of {len(test_rows)} test rows")
    info = {"steps": result.global_step, "train_rows": len(train_rows), "validation_rows": len(val_rows),
            "test_rows": len(test_rows), "train_seconds": train_seconds, "predict_seconds": predict_seconds,
            "calibrated": model.causal_config.value_calibration is not None,
            "validation_value_mae": (result.eval_metrics or {}).get("value_mae"),
            "adapter": str(result.adapter_dir)}
    if predict.get("horizon"):  # the per-step maps fitted on the validation rows: u per row or per step, steps
        cal = model.causal_config.horizon_calibration
        info.update(individual=None if cal is None else cal["individual"],
                    calibrated_steps=1 + (0 if cal is None else len(cal["steps"])))
    return [preds[i] for i in range(len(test_rows))], info


def run_arguments(doc: str, output: str, seed_help: str, rows: bool = True) -> argparse.ArgumentParser:
    """The parser of a script that trains with `train_and_predict`: --steps, --max-train-rows / --max-val-rows
    (`rows`), --output, --seed (`seed_help`); `check_run_arguments` checks them."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=None,
                    help="optimizer steps per adapter (default: TrainConfig's, max_steps -1: num_train_epochs 3)")
    if rows:
        ap.add_argument("--max-train-rows", type=int, default=None,
                        help="keep only the last N training rows of each series (default all)")
        ap.add_argument("--max-val-rows", type=int, default=None,
                        help="keep only the last N validation rows of each series in the adapter's validation file "
                        "(default all; the baselines are always chosen on every validation target)")
    ap.add_argument("--output", default=output, help="markdown tables; the JSON goes beside it (.json)")
    ap.add_argument("--seed", type=int, default=42, help=seed_help)
    return ap


def check_run_arguments(ap: argparse.ArgumentParser, args) -> None:
    """--steps, --max-train-rows, --max-val-rows: each >= 1 where given."""
    for k in ("steps", "max_train_rows", "max_val_rows"):
        if getattr(args, k, None) is not None and getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")


def code_state() -> dict:
    """The commit and the files changed since it (the benchmark measures the working tree as it is)."""
    root = Path(__file__).resolve().parents[1]
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()
    try:
        return {"commit": run("rev-parse", "HEAD"), "changed": run("status", "--short").splitlines()}
    except OSError:
        return {}


# ----------------------------------------------------------------------------- models
def build_base(layers: int, seed: int = 0, vocab_size: int = 151_936, device=None, dtype=None, **config):
    """The Qwen2.5-0.5B shape (hidden 896, 14 / 2 heads, intermediate 4864, tied) with `layers` decoder layers and
    random weights (torch seed `seed`), in eval mode; on `device` (initialised there: fast on a GPU), cast to
    `dtype`. `config`: more Qwen2Config fields (token ids, attn_implementation)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=4096, **config)
    torch.manual_seed(seed)
    if device is None:
        return Qwen2ForCausalLM(cfg).eval()
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype or torch.float32).eval()


# ----------------------------------------------------------------------------- device helpers
def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_time(step: Callable[[], object], device, warmup: int = 2, repeats: int = 5,
              before_each: Callable[[], None] | None = None) -> tuple[float, list[float]]:
    """(fastest, all) wall seconds of `step` over `repeats` calls after `warmup` untimed ones, the device
    synchronised before and after each call; `before_each` (e.g. dropping gradients) runs untimed."""
    for _ in range(warmup):
        if before_each:
            before_each()
        step()
    times = []
    for _ in range(repeats):
        if before_each:
            before_each()
        synchronize(device)
        t = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return min(times), times


def machine_line(device) -> str:
    """One line: the device, torch / triton / transformers versions."""
    from importlib.metadata import version

    parts = [f"torch {torch.__version__}"]
    for name in ("triton", "transformers", "peft", "accelerate", "liger_kernel", "cut_cross_entropy"):
        try:
            parts.append(f"{name} {version(name.replace('_', '-'))}")
        except Exception:
            parts.append(f"{name} -")
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        dev = f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"
    else:
        dev = f"CPU ({torch.get_num_threads()} threads)"
    return f"device: {dev}; " + ", ".join(parts)
