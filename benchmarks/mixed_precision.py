"""Mixed precision on CPU, the way a GPU run computes (docs/mixed_precision.md).

    python benchmarks/mixed_precision.py              # 60 steps per training run (~6 min on 2 cores)
    python benchmarks/mixed_precision.py --steps 20   # quicker, noisier

Three measurements, each against its own baseline in the same run:

* ``grads``: a bf16 tiny Qwen (vocab 320, LoRA r 4) under ``torch.autocast('cpu', bfloat16)`` against the
  same model without autocast: the worst cosine over the adapter gradients and max |loc_Y| difference
  / value_scale. Baseline: the same with autocast reaching the heads and losses (the code before
  `heads.full_precision`, simulated by switching that context off).
* ``sunspots``: benchmarks/bf16_corpora.py's measurement (`common.bf16_against_fp32`) on sunspots: the
  CLI's default recipe (`causal-adapter train`: embedded tiny Qwen, sunspots, ridge warm start, ...) for
  ``--steps`` optimizer steps, ``mixed_precision="no"`` against ``"bf16"`` (accelerate's CPU autocast); the
  saved adapters are scored on the TEST split as `causal-adapter eval` does (a fresh float32 model, no
  autocast: how the adapter is used), and the bf16 run again under bf16 autocast (a use the head is not
  fitted for: `train` fits it on the features inference computes, `engines.inference_precision`). Also the
  value fit's summary of each run (penalty, |w|, leave-one-out MAE). Other corpora, a GPU, fp16 and a bf16
  base: benchmarks/bf16_corpora.py.
* ``gemm``: benchmarks/loss_precision.py's part (a) (`common.gemm_errors`: `fused_ovr_loss` with
  ``gemm_precision`` fp32 / tf32 / bf16, tf32 and bf16 emulated by operand rounding on CPU, against
  `reference_ovr_loss` in float64) on the tiny Qwen's own inputs at the real vocabulary (its lm_head's
  151,936 rows, 128 positions; W frozen): loss relative error and worst gradient cosine; and the bf16-W
  product `heads.linear_in_dtype` (W upcast by chunks) against the old x-cast-down product. Synthetic
  shapes, both regimes, W trained and the Triton backend: benchmarks/loss_precision.py.

Ends with ONE line ``RESULT key=value ...``: ``bf16_vs_fp32_value_mae`` (test MAE of the bf16 run as
`causal-adapter eval` scores it / the fp32 run's; the goal <= 1.15),
``bf16_vs_fp32_value_mae_autocast_eval`` (the bf16 run scored under bf16 autocast), ``worst_grad_cos``,
``loc_Y_err_over_scale``, ``gemm_<p>_loss_rel_err`` / ``gemm_<p>_grad_cos``, and
``fsdp_accelerate_wrap`` (`benchmarks/fsdp_wrap.py` run as a subprocess; ``--no-fsdp`` skips it).
"""
from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common import GEMMS, bf16_against_fp32, bf16_lora_model_and_batch, cosine, gemm_errors


# ----------------------------------------------------------------------------- gradients
def grad_check(heads_in_autocast: bool) -> dict:
    """Worst adapter-gradient cosine and max |loc_Y| error / value_scale, bf16 autocast vs none."""
    from unittest import mock

    model, ids, values = bf16_lora_model_and_batch()
    ctx = (mock.patch("causal_adapter.modeling.heads.full_precision", lambda device: contextlib.nullcontext())
           if heads_in_autocast else contextlib.nullcontext())
    runs = {}
    with ctx:
        for autocast in (False, True):  # the reference without autocast, then under bf16 autocast
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(ids, values, labels=ids)
            out.loss.backward()
            runs[autocast] = out, {n: p.grad.detach().double().clone() for n, p in model.trainable_parameters()}
    (ref, ref_grads), (amp, amp_grads) = runs[False], runs[True]
    cos = {n: cosine(amp_grads[n], g) for n, g in ref_grads.items() if g.abs().sum() > 0}
    worst = min(cos, key=cos.get)
    err = float((amp.loc_Y.double() - ref.loc_Y.double()).abs().max()) / model.action.value_scale
    return {"worst_grad_cos": cos[worst], "worst_param": worst, "num_row_cos": cos.get("action.num_row"),
            "loc_Y_err_over_scale": err}


# ----------------------------------------------------------------------------- GEMM precision
def gemm_accuracy(rows: int = 128) -> dict:
    """Fused-loss accuracy per gemm_precision against float64 (`common.gemm_errors`) on the tiny Qwen's inputs
    at the real vocabulary; the bf16-W products of `linear_in_dtype`."""
    from causal_adapter import CausalAdapterConfig, get_causal_model
    from causal_adapter.saving.assets import build_tiny_qwen
    from causal_adapter.modeling.heads import linear_in_dtype

    model = get_causal_model(build_tiny_qwen("qwen2", seed=0), CausalAdapterConfig(num_token_id=151665))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151000, (1, rows + 1), generator=g)
    with torch.no_grad():
        out = model(ids)
    lu, su = out.loc_U[0, :rows], model.action.noisy_scale(out.scale_U[0, :rows])
    W, y = model.W_cls.detach(), ids[0, 1:]
    b = model.action.b_cls.detach() + 0.1 * torch.randn(W.shape[0], generator=g)  # a trained-like bias
    x = dict(loc_U=lu, scale_Up=su, W=W, b=b, thr=model.action.thresholds.detach(), labels=y)
    res = {r["gemm"]: {"loss_rel_err": r["loss"], "grad_cos": r["grad_cos"]}
           for r in gemm_errors(x, False, ["torch"], GEMMS)}
    Wb = W.bfloat16()
    exact = lu.double() @ Wb.double().T
    scale = float(exact.abs().max())
    res["linear_in_dtype"] = {
        "W_upcast_max_err_rel": float((linear_in_dtype(lu, Wb).double() - exact).abs().max()) / scale,
        "x_downcast_max_err_rel": float(((lu.bfloat16() @ Wb.T).double() - exact).abs().max()) / scale,
    }
    return res


def fsdp_wrap_result() -> str:
    """`benchmarks/fsdp_wrap.py` (accelerate's FSDP1 wrap for fsdp.yaml, 2 gloo processes): "ok" or "failed"."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("fsdp_wrap.py"))], capture_output=True,
                          text=True, timeout=900)
    found = re.search(r"RESULT fsdp_accelerate_wrap=(\S+)", proc.stdout)
    print(f"fsdp: {proc.stdout.strip().splitlines()[-2] if proc.stdout.strip().count(chr(10)) else proc.stderr[-300:]}")
    return found.group(1) if found else "failed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per training run")
    parser.add_argument("--no-fsdp", action="store_true", help="skip benchmarks/fsdp_wrap.py (2 processes, ~45 s)")
    args = parser.parse_args()
    torch.set_num_threads(2)

    before, after = grad_check(heads_in_autocast=True), grad_check(heads_in_autocast=False)
    print(f"grads (bf16 base, bf16 autocast vs none): worst cosine {after['worst_grad_cos']:.6f} "
          f"({after['worst_param']}), <NUM> row {after['num_row_cos']:.6f}, |dloc_Y|/value_scale "
          f"{after['loc_Y_err_over_scale']:.2e}")
    print(f"  baseline, autocast reaching the heads: worst cosine {before['worst_grad_cos']:.4f} "
          f"({before['worst_param']}), <NUM> row {before['num_row_cos']:.4f}, |dloc_Y|/value_scale "
          f"{before['loc_Y_err_over_scale']:.2e}")

    gemm = gemm_accuracy()
    for p in GEMMS:
        print(f"fused loss gemm_precision={p}: loss rel. error {gemm[p]['loss_rel_err']:.2e}, worst grad cosine "
              f"{gemm[p]['grad_cos']:.8f} (vs float64)")
    lin = gemm["linear_in_dtype"]
    print(f"loc_S from a bf16 W: W upcast by chunks max error {lin['W_upcast_max_err_rel']:.2e} of max|loc_S|; "
          f"x cast down (before) {lin['x_downcast_max_err_rel']:.2e}")

    with tempfile.TemporaryDirectory() as tmp:
        runs = bf16_against_fp32("sunspots", args.steps, Path(tmp), device_eval=True)
    print(f"  baseline: the fp32 run's test MAE {runs['no']['test_mae']:.2f}")

    result = {
        "bf16_vs_fp32_value_mae": runs["bf16"]["test_mae"] / runs["no"]["test_mae"],
        "bf16_vs_fp32_value_mae_autocast_eval": runs["bf16"]["device_test_mae"] / runs["no"]["test_mae"],
        "steps": args.steps,
        "worst_grad_cos": after["worst_grad_cos"],
        "worst_grad_cos_before": before["worst_grad_cos"],
        "loc_Y_err_over_scale": after["loc_Y_err_over_scale"],
        **{f"gemm_{p}_loss_rel_err": gemm[p]["loss_rel_err"] for p in GEMMS},
        **{f"gemm_{p}_grad_cos": gemm[p]["grad_cos"] for p in GEMMS},
    }
    if not args.no_fsdp:
        result["fsdp_accelerate_wrap"] = fsdp_wrap_result()
    print("RESULT " + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
