"""The fused OvR loss's GEMM precision, measured (docs/mixed_precision.md): what it costs in accuracy, and whether a
training run notices.

    python benchmarks/loss_precision.py                       # CPU: (a) emulated roundings, (b) 40 steps; ~2 min
    python benchmarks/loss_precision.py --device cuda         # GPU: (a) both backends, (b) 300 steps; < 2 min
    python benchmarks/loss_precision.py --part a              # only (a) (or --part b)

(a) ``accuracy``: `fused_ovr_loss` with ``gemm_precision`` fp32 / tf32 / bf16 against `reference_ovr_loss` in
    float64 on the same inputs (the float32 inputs, upcast): the relative error of the loss and of every
    gradient, ||g - g_ref|| / ||g_ref|| (loc_U, scale_U', b_cls, the thresholds as a [V] vector, W when it
    trains). Shape C = 896, V = --vocab (8,000), N = --rows (512) rows, W ~ N(0, 0.02^2) like an lm_head,
    loc_U ~ N(0, 3^2), b_cls ~ N(0, 0.1^2), in two regimes: ``init`` (the SPEC's seeds: thresholds 100,
    scale_U' ~ 10, i.e. scale_S ~ 140) and ``recipe`` (`causal-adapter train`'s defaults: thresholds 1,
    scale_U' ~ 0.1). On CPU the torch backend emulates tf32 / bf16 by rounding the operands (the accuracy,
    not the speed); on CUDA both backends run (torch: tf32 by the hardware, bf16 emulated; triton: tensor
    cores). ``--backends`` picks (triton on CPU needs TRITON_INTERPRET=1 and is slow: use tiny shapes).
(b) ``training``: `train()` with `TrainConfig`'s defaults (the embedded tiny Qwen2, hidden 64, 2 layers, the
    full 151,936-row vocabulary; frozen backbone) on a bundled corpus (--corpus sunspots) for --steps
    steps, once per GEMM precision, set through CAUSAL_ADAPTER_LOSS_GEMM; same seed, data order and
    initialisation, ``mixed_precision="no"`` (``--mixed-precision bf16`` for accelerate's autocast): only the
    loss's GEMMs differ. Prints the training loss every --log-every steps side by side, the validation
    value MAE of the final evaluation and the test MAE as `causal-adapter eval` computes it (CPU, float32),
    each as a ratio to the fp32 run.

Ends with ONE line ``RESULT key=value ...``: ``a_<backend>_<gemm>_loss_rel`` / ``_grad_rel`` (the worst over
regimes and W modes), ``b_<gemm>_vs_fp32_test_mae``, ``b_<gemm>_vs_fp32_val_mae``, ``b_<gemm>_vs_fp32_val_loss_cls`` (the validation
OvR loss), ``b_<gemm>_loss_rel_max`` (the largest relative difference of the logged training loss from the fp32
run's). With `train`'s default head (it reads the 32 recent values exactly) the value MAE barely depends on
the OvR side; ``--recent-values 0`` makes the head read loc_U alone, the features the OvR loss trains.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
from pathlib import Path

import torch

from common import GEMMS, gemm_errors, grad_errors, loss_and_grads, machine_line, test_mae

REGIMES = {"init": (100.0, 10.0), "recipe": (1.0, 0.1)}  # (thresholds, scale_U')


# ----------------------------------------------------------------------------- (a) accuracy
def problem(N: int, V: int, C: int, thr: float, scale: float, device, seed: int = 0) -> dict:
    """float32 inputs of one regime (see the top)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    return dict(loc_U=randn(N, C) * 3, scale_Up=scale * (1 + 0.2 * torch.rand(N, C, generator=g, device=device)),
                W=randn(V, C) * 0.02, b=randn(V) * 0.1, thr=thr + 0.1 * randn(V),
                labels=torch.randint(0, V, (N,), generator=g, device=device))


def plain_lora_ce(lu, su, W, b, thr, labels):
    """The yardstick: cross-entropy as plain LoRA computes it under bf16 autocast (bf16 logits, upcast);
    in float64 (the reference) without autocast. Same signature as the OvR losses (su, b, thr unused)."""
    import torch.nn.functional as F

    if lu.dtype == torch.float64:
        return F.cross_entropy(lu @ W.T, labels)
    with torch.autocast(lu.device.type, dtype=torch.bfloat16):
        logits = F.linear(lu, W)
    return F.cross_entropy(logits.float(), labels) + 0 * (su.sum() + b.sum() + thr.sum())  # (their grads: 0)


def accuracy(device, rows: int, vocab: int, backends: list[str], gemms: list[str]) -> list[dict]:
    """`common.gemm_errors` per regime and W mode; in the init regime also the CE yardstick against itself in
    float64."""
    out = []
    for regime, (thr, scale) in REGIMES.items():
        x = problem(rows, vocab, 896, thr, scale, device)
        for train_W in (False, True):
            w_mode = "trained" if train_W else "frozen"
            out += [dict(regime=regime, w_mode=w_mode, **row) for row in gemm_errors(x, train_W, backends, gemms)]
        if regime == "init":  # the yardstick once: CE reads loc_U and W only
            for train_W in (False, True):
                ref = loss_and_grads(plain_lora_ce, x, torch.float64, train_W)
                out.append(dict(regime="-", w_mode="trained" if train_W else "frozen", backend="CE", gemm="bf16",
                                **grad_errors(ref, *loss_and_grads(plain_lora_ce, x, torch.float32, train_W))))
    return out


def print_accuracy(rows: list[dict], result: dict) -> None:
    cols = ("loss", "loc_U", "scale_Up", "b", "thr", "W")
    hdr = f"{'regime':>7} {'W':>8} {'backend':>8} {'gemm':>5} " + " ".join(f"{c:>9}" for c in cols)
    print("\n(a) relative error against reference_ovr_loss in float64 (||g - g_ref|| / ||g_ref|| for gradients); "
          "the CE rows: plain LoRA's bf16-logit cross-entropy against its float64 self, for scale")
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        head = f"{r['regime']:>7} {r['w_mode']:>8} {r['backend']:>8} {r['gemm']:>5} "
        if "error" in r:
            print(head + f"  not run: {r['error']}")
            continue
        print(head + " ".join(f"{r[c]:>9.2e}" if c in r else f"{'':>9}" for c in cols))
        key = f"a_{r['backend'].lower()}_{r['gemm']}"
        grad = max(r[c] for c in cols[1:] if c in r)
        result[f"{key}_loss_rel"] = max(result.get(f"{key}_loss_rel", 0.0), r["loss"])
        result[f"{key}_grad_rel"] = max(result.get(f"{key}_grad_rel", 0.0), grad)


# ----------------------------------------------------------------------------- (b) training
def train_with_gemm(gemm: str, args, out_dir: Path) -> dict:
    """One `train()` run with CAUSAL_ADAPTER_LOSS_GEMM=gemm: its logged losses, validation and test MAE."""
    from causal_adapter.modeling.loss import GEMM_ENV
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import train

    curve = []

    def log_loss(state, logs):
        if "loss" in logs:
            curve.append((logs["step"], logs["loss"], logs["loss_cls"], logs["loss_reg"]))

    config = TrainConfig(dataset=args.corpus, max_steps=args.steps, output_dir=str(out_dir), cpu=args.device == "cpu",
                         plot=False, progress=False, eval_steps=0, logging_steps=args.log_every,
                         mixed_precision=args.mixed_precision, lora=args.lora, seed=args.seed,
                         **({} if args.recent_values is None else {"recent_values": args.recent_values}))
    old = os.environ.get(GEMM_ENV)
    os.environ[GEMM_ENV] = gemm
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the value head's fit summaries
            result = train(config=config, callbacks=[log_loss])
    finally:
        if old is None:
            os.environ.pop(GEMM_ENV, None)
        else:
            os.environ[GEMM_ENV] = old
    seconds = time.perf_counter() - t0
    metrics = result.eval_metrics or {}
    return dict(curve=curve, seconds=seconds, val_mae=metrics.get("value_mae"), val_loss_cls=metrics.get("loss_cls"),
                test_mae=test_mae(result.adapter_dir, False, args.corpus))


def training(args, gemms: list[str], result: dict) -> None:
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for gemm in gemms:
            runs[gemm] = train_with_gemm(gemm, args, Path(tmp) / gemm)
            r = runs[gemm]
            print(f"(b) {args.corpus}, {args.steps} steps on {args.device}, loss GEMMs {gemm}: {r['seconds']:.0f} s, "
                  f"validation value MAE {r['val_mae']:.5g}, test MAE {r['test_mae']:.5g}, validation OvR loss "
                  f"{r['val_loss_cls']:.6g}", flush=True)
    base = runs.get("fp32")
    others = [g for g in gemms if g != "fp32"]
    print(f"\n(b) training loss every {args.log_every} steps" + (" (relative difference to fp32)" if base else ""))
    print(f"{'step':>6} " + " ".join(f"{g:>12}" for g in gemms) + "".join(f" {'d ' + g:>10}" for g in others if base))
    steps = [c[0] for c in runs[gemms[0]]["curve"]]
    for i, step in enumerate(steps):
        vals = {g: runs[g]["curve"][i][1] for g in gemms if i < len(runs[g]["curve"])}
        line = f"{step:>6} " + " ".join(f"{vals.get(g, float('nan')):>12.5g}" for g in gemms)
        if base:
            line += "".join(f" {(vals[g] - vals['fp32']) / abs(vals['fp32']):>+10.2e}" for g in others
                            if g in vals and "fp32" in vals)
        print(line)
    for g in gemms:
        last = runs[g]["curve"][-1] if runs[g]["curve"] else None
        if last:
            print(f"  {g}: final loss {last[1]:.6g} (cls {last[2]:.6g}, reg {last[3]:.6g})")
    result["b_steps"] = args.steps
    result["b_corpus"] = args.corpus
    for g in gemms:
        result[f"b_{g}_test_mae"] = round(runs[g]["test_mae"], 5)
        if base and g != "fp32":
            result[f"b_{g}_vs_fp32_test_mae"] = round(runs[g]["test_mae"] / base["test_mae"], 4)
            for key in ("val_mae", "val_loss_cls"):
                if base[key] and runs[g][key] is not None:
                    result[f"b_{g}_vs_fp32_{key}"] = round(runs[g][key] / base[key], 5)
            diffs = [abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(runs[g]["curve"], base["curve"])]
            if diffs:
                result[f"b_{g}_loss_rel_max"] = float(f"{max(diffs):.3g}")
                result[f"b_{g}_loss_rel_final"] = float(f"{diffs[-1]:.3g}")


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--part", default="all", choices=("a", "b", "all"))
    ap.add_argument("--gemms", default=None, help="comma-separated (a: fp32,tf32,bf16; b: fp32,bf16)")
    ap.add_argument("--rows", type=int, default=512, help="(a) N")
    ap.add_argument("--vocab", type=int, default=8000, help="(a) V")
    ap.add_argument("--backends", default=None, help="(a) comma-separated torch,triton (default: torch on CPU, "
                                                      "both on CUDA)")
    ap.add_argument("--steps", type=int, default=None, help="(b) optimizer steps per run (default 40 CPU, 300 CUDA)")
    ap.add_argument("--log-every", type=int, default=None, help="(b) print the loss every k steps (default steps/10)")
    ap.add_argument("--corpus", default="sunspots", help="(b) a bundled corpus (causal_adapter.data.corpora)")
    ap.add_argument("--mixed-precision", default="no", choices=("no", "bf16"), help="(b) accelerate's setting")
    ap.add_argument("--lora", action="store_true", help="(b) LoRA on the tiny backbone")
    ap.add_argument("--recent-values", type=int, default=None,
                    help="(b) TrainConfig.recent_values (default: train's; 0: the value head reads loc_U alone, "
                         "the features the OvR loss trains)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    print(machine_line(device), flush=True)
    result: dict = {"device": device.type}
    if args.part in ("a", "all"):
        backends = (args.backends or ("torch,triton" if device.type == "cuda" else "torch")).split(",")
        gemms = (args.gemms or ",".join(GEMMS)).split(",")
        print(f"(a) C=896 V={args.vocab} N={args.rows}; regimes (thresholds, scale_U'): {REGIMES}", flush=True)
        t0 = time.perf_counter()
        print_accuracy(accuracy(device, args.rows, args.vocab, backends, gemms), result)
        print(f"(a) {time.perf_counter() - t0:.0f} s", flush=True)
    if args.part in ("b", "all"):
        args.steps = args.steps or (300 if device.type == "cuda" else 40)
        args.log_every = args.log_every or max(1, args.steps // 10)
        gemms = (args.gemms or "fp32,bf16").split(",")
        if "fp32" in gemms:  # the baseline first
            gemms = ["fp32"] + [g for g in gemms if g != "fp32"]
        training(args, gemms, result)
    print("RESULT " + " ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
