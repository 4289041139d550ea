"""bf16 against fp32: does mixed precision keep the adapter's gradients, loc_Y and the CLI recipe's test MAE?

    python benchmarks/mixed_precision.py                      # the three checks below, sunspots, 60 steps (~6 min)
    python benchmarks/mixed_precision.py --corpora sunspots,co2,macro --steps 300 [--device cuda] [--variants fp16,bf16-base]

Default: three measurements on CPU, each against its own baseline in the same run (docs/mixed_precision.md):

* ``grads``: a bf16 tiny Qwen (vocab 320, LoRA r 4) under ``torch.autocast('cpu', bfloat16)`` against the
  same model without autocast: the worst cosine over the adapter gradients and max |loc_Y| difference
  / value_scale. Baseline: the same with autocast reaching the heads and losses (the code before
  `heads.full_precision`, simulated by switching that context off).
* ``sunspots``: the CLI's default recipe (`common.bf16_against_fp32`) for ``--steps`` steps,
  ``mixed_precision="no"`` against ``"bf16"``; the saved adapters scored on the TEST split as `causal-adapter
  eval` does (a fresh float32 model, no autocast), and the bf16 run again under bf16 autocast.
* ``gemm``: `common.gemm_errors` (`fused_ovr_loss` with ``gemm_precision`` fp32 / tf32 / bf16, emulated by
  operand rounding on CPU, against `reference_ovr_loss` in float64) on the tiny Qwen's own inputs at the real
  vocabulary (151,936 rows, 128 positions; W frozen); and the bf16-W product `heads.linear_in_dtype` against
  the x-cast-down product.

One ``RESULT`` line: ``bf16_vs_fp32_value_mae`` (goal <= 1.15), ``bf16_vs_fp32_value_mae_autocast_eval``,
``worst_grad_cos``, ``loc_Y_err_over_scale``, ``gemm_<p>_loss_rel_err`` / ``gemm_<p>_grad_cos``.

``--corpora A,B``: the recipe per corpus instead (the second question): ``--mixed-precision no`` then ``bf16``
in this process, validation MAE and test MAE as `eval` computes it; ``--device cuda`` trains on the GPU
(CUDA autocast) and scores the test split again there under bf16 autocast (``gpu_autocast_ratio``);
``--variants fp16,bf16-base``: more runs against the same fp32 one (fp16 mixed precision: accelerate's
GradScaler on a GPU; a base held in bf16 under bf16 mixed precision, scored on a bf16 base). One ``RESULT
corpus=... test_ratio=... val_ratio=...`` line per corpus (and per variant).
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch

from common import (GEMMS, bf16_against_fp32, bf16_lora_model_and_batch, cosine, gemm_errors, offline, test_mae,
                    train_run)


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
    err = float((amp.loc_Y.double() - ref.loc_Y.double()).abs().max()) / model.action.head_scale
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


def corpora_main(args) -> None:
    """The recipe per corpus, fp32 against bf16 (and --variants), one RESULT line each."""
    overrides = {} if args.recent_values is None else {"recent_values": args.recent_values}
    for corpus in args.corpora.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            runs = bf16_against_fp32(corpus, args.steps, Path(tmp), args.device, args.device != "cpu", **overrides)
            val = {mp: r["val_mae"] for mp, r in runs.items()}
            test = {mp: r["test_mae"] for mp, r in runs.items()}
            amp = {mp: r["device_test_mae"] for mp, r in runs.items() if "device_test_mae" in r}
            for variant in filter(None, args.variants.split(",")):
                mp, dtype = {"fp16": ("fp16", "float32"), "bf16-base": ("bf16", "bfloat16")}[variant]
                run = train_run(mp, args.steps, Path(tmp) / variant, corpus, args.device, torch_dtype=dtype, **overrides)
                v_test = test_mae(run["adapter"], False, corpus, args.device, base_dtype=dtype)
                print(f"{corpus} {variant}: {run['seconds']:.0f} s, value fit {run['ridge']}, validation MAE "
                      f"{run['val_mae']:.4g}, test MAE {v_test:.4g} (base {dtype})", flush=True)
                print(f"RESULT corpus={corpus} variant={variant} device={args.device} test_ratio={v_test / test['no']:.4g} "
                      f"val_ratio={run['val_mae'] / val['no']:.4g}", flush=True)
        gpu = f" gpu_autocast_ratio={amp['bf16'] / amp['no']:.4g}" if amp else ""
        k = "" if args.recent_values is None else f" recent_values={args.recent_values}"
        print(f"RESULT corpus={corpus} steps={args.steps} device={args.device}{k} test_ratio={test['bf16'] / test['no']:.4g} "
              f"val_ratio={val['bf16'] / val['no']:.4g}{gpu}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per training run")
    parser.add_argument("--corpora", default=None, help="comma-separated: the recipe per corpus instead (see above)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="with --corpora")
    parser.add_argument("--variants", default="", help="with --corpora, comma-separated: fp16, bf16-base")
    parser.add_argument("--recent-values", type=int, default=None,
                        help="with --corpora: TrainConfig.recent_values (default: train's; 0: the head reads loc_U alone)")
    args = parser.parse_args()
    offline()
    if args.corpora:
        return corpora_main(args)
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
    print("RESULT " + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
