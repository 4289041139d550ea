"""Mixed precision on CPU, the way a GPU run computes (docs/mixed_precision.md).

    python benchmarks/mixed_precision.py              # 60 steps per training run (~6 min on 2 cores)
    python benchmarks/mixed_precision.py --steps 20   # quicker, noisier

Three measurements, each against its own baseline in the same run:

* ``grads``: a bf16 tiny Qwen (vocab 320, LoRA r 4) under ``torch.autocast('cpu', bfloat16)`` against the
  same model without autocast: the worst cosine over the adapter gradients and max |loc_Y| difference
  / value_scale. Baseline: the same with autocast reaching the heads and losses (the code before
  `heads.full_precision`, simulated by switching that context off).
* ``sunspots``: the CLI's default recipe (`causal-adapter train`: embedded tiny Qwen, sunspots, ridge
  warm start, ...) for ``--steps`` optimizer steps, ``mixed_precision="no"`` against ``"bf16"``
  (accelerate's CPU autocast); the saved adapters are scored on the TEST split as `causal-adapter eval`
  does (a fresh float32 model, no autocast: how the adapter is used), and again under bf16 autocast
  (a use the head is not fitted for: `train` fits it on the features inference computes,
  `engines.inference_precision`). Also the value fit's summary of each run (penalty, |w|,
  leave-one-out MAE).
* ``gemm``: the fused OvR loss at the real vocabulary (151,936 rows, the tiny Qwen's lm_head, 128 rows)
  with ``gemm_precision`` fp32 / tf32 / bf16 (tf32 and bf16 emulated by operand rounding: accuracy, not
  speed) against a float64 reference: loss relative error and worst gradient cosine; and the bf16-W
  product `heads.linear_in_dtype` (W upcast by chunks) against the old x-cast-down product.

Ends with ONE line ``RESULT key=value ...``: ``bf16_vs_fp32_value_mae`` (test MAE of the bf16 run as
`causal-adapter eval` scores it / the fp32 run's; the goal <= 1.15),
``bf16_vs_fp32_value_mae_autocast_eval`` (the bf16 run scored under bf16 autocast), ``worst_grad_cos``,
``loc_Y_err_over_scale``, ``gemm_<p>_loss_rel_err`` / ``gemm_<p>_grad_cos``, and
``fsdp_accelerate_wrap`` (`benchmarks/fsdp_wrap.py` run as a subprocess; ``--no-fsdp`` skips it).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


# ----------------------------------------------------------------------------- gradients
def grad_check(heads_in_autocast: bool) -> dict:
    """Worst adapter-gradient cosine and max |loc_Y| error / value_scale, bf16 autocast vs none."""
    from unittest import mock

    from test_mixed_precision import bf16_model, cosine, numeric_batch, run

    model = bf16_model()
    ids, values = numeric_batch()
    ctx = (mock.patch("causal_adapter.modeling.heads.full_precision", lambda device: contextlib.nullcontext())
           if heads_in_autocast else contextlib.nullcontext())
    with ctx:
        ref, ref_grads = run(model, ids, values)
        amp, amp_grads = run(model, ids, values, torch.bfloat16)
    cos = {n: cosine(amp_grads[n], g) for n, g in ref_grads.items() if g.abs().sum() > 0}
    worst = min(cos, key=cos.get)
    err = float((amp.loc_Y.double() - ref.loc_Y.double()).abs().max()) / model.action.value_scale
    return {"worst_grad_cos": cos[worst], "worst_param": worst, "num_row_cos": cos.get("action.num_row"),
            "loc_Y_err_over_scale": err}


# ----------------------------------------------------------------------------- sunspots
def train_run(mixed_precision: str, steps: int, out_dir: Path, corpus: str = "sunspots", device: str = "cpu",
              **overrides) -> dict:
    """The CLI's default recipe for `steps` steps; the value-head summary it prints; the adapter dir.
    device "cpu" forces CPU (CPU autocast); "cuda": accelerate's own device choice (a GPU's autocast).
    overrides: other TrainConfig fields (e.g. recent_values=0)."""
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import train

    config = TrainConfig(dataset=corpus, max_steps=steps, mixed_precision=mixed_precision, output_dir=str(out_dir),
                         cpu=device == "cpu", plot=False, progress=False, eval_steps=0, **overrides)
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        result = train(config=config)
    seconds = time.perf_counter() - t0
    summary = dict(re.findall(r"(\w+)=([^,\s]+)", next((line for line in err.getvalue().splitlines()
                                                         if line.startswith("value head:")), "")))
    return {"adapter": result.adapter_dir, "seconds": seconds, "val_mae": (result.eval_metrics or {}).get("value_mae"),
            "ridge": {k: summary.get(k) for k in ("ridge_lambda", "w_norm", "loo_mae", "inputs")}}


def test_mae(adapter_dir: Path, autocast: bool, corpus: str = "sunspots", device: str = "cpu",
             base_dtype: str = "float32") -> float:
    """Test-split value MAE of a saved adapter, as `causal-adapter eval` computes it (fresh float32
    model), optionally under bf16 autocast; on `device` ("cpu" as `eval` runs, or "cuda"); `base_dtype`:
    the base's weights (as `eval --dtype`)."""
    from causal_adapter.saving.assets import load_base
    from causal_adapter.data.corpora import build_corpus
    from causal_adapter.data.pipeline import tokenize_dataset
    from causal_adapter.training.metrics import evaluate_dataset
    from causal_adapter.model import CausalModel
    from causal_adapter.numbers import NumberTokenizer

    base, tokenizer = load_base(None, "qwen2", base_dtype, 64, 2)
    model = CausalModel.from_pretrained(base, adapter_dir, tokenizer=tokenizer).to(device)
    ntok = NumberTokenizer(tokenizer, model.num_token_id)
    ds = tokenize_dataset(build_corpus(corpus)["test"], ntok)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
        return float(evaluate_dataset(model, ds, ntok.pad_token_id, batch_size=16)["value_mae"])


# ----------------------------------------------------------------------------- GEMM precision
def gemm_accuracy(rows: int = 128) -> dict:
    """Fused-loss accuracy per gemm_precision against float64, at the real vocabulary."""
    from causal_adapter import CausalAdapterConfig, get_causal_model
    from causal_adapter.saving.assets import build_tiny_qwen
    from causal_adapter.modeling.heads import linear_in_dtype
    from causal_adapter.modeling.loss import fused_ovr_loss

    model = get_causal_model(build_tiny_qwen("qwen2", seed=0), CausalAdapterConfig(num_token_id=151665))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151000, (1, rows + 1), generator=g)
    with torch.no_grad():
        out = model(ids)
    lu, su = out.loc_U[0, :rows], model.action.noisy_scale(out.scale_U[0, :rows])
    W, y = model.W_cls.detach(), ids[0, 1:]
    b = model.action.b_cls.detach() + 0.1 * torch.randn(W.shape[0], generator=g)  # a trained-like bias

    def loss_and_grads(dtype, gemm):
        xs = [t.detach().to(dtype).requires_grad_() for t in (lu, su, b)]
        loss = fused_ovr_loss(xs[0], xs[1], W.to(dtype), xs[2], model.action.thresholds.to(dtype), y,
                              gemm_precision=gemm, compile=False)
        loss.backward()
        return loss.double(), [x.grad.double() for x in xs]

    ref_loss, ref_grads = loss_and_grads(torch.float64, "fp32")
    res = {}
    for gemm in ("fp32", "tf32", "bf16"):
        loss, grads = loss_and_grads(torch.float32, gemm)
        cos = min(float(a.flatten() @ r.flatten() / (a.norm() * r.norm())) for a, r in zip(grads, ref_grads))
        res[gemm] = {"loss_rel_err": float((loss - ref_loss).abs() / ref_loss.abs()), "grad_cos": cos}
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
    import subprocess

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
    for p in ("fp32", "tf32", "bf16"):
        print(f"fused loss gemm_precision={p}: loss rel. error {gemm[p]['loss_rel_err']:.2e}, worst grad cosine "
              f"{gemm[p]['grad_cos']:.8f} (vs float64)")
    lin = gemm["linear_in_dtype"]
    print(f"loc_S from a bf16 W: W upcast by chunks max error {lin['W_upcast_max_err_rel']:.2e} of max|loc_S|; "
          f"x cast down (before) {lin['x_downcast_max_err_rel']:.2e}")

    runs, mae = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mp in ("no", "bf16"):
            runs[mp] = train_run(mp, args.steps, Path(tmp) / mp)
            mae[mp] = {"fp32_eval": test_mae(runs[mp]["adapter"], False), "bf16_eval": test_mae(runs[mp]["adapter"], True)}
            print(f"sunspots {args.steps} steps, mixed_precision={mp}: {runs[mp]['seconds']:.0f} s, ridge warm start "
                  f"{runs[mp]['ridge']}, validation MAE {runs[mp]['val_mae']:.2f}, test MAE {mae[mp]['fp32_eval']:.2f} "
                  f"(float32 eval) / {mae[mp]['bf16_eval']:.2f} (bf16 autocast eval)")
    print(f"  baseline: the fp32 run's test MAE {mae['no']['fp32_eval']:.2f}")

    result = {
        "bf16_vs_fp32_value_mae": mae["bf16"]["fp32_eval"] / mae["no"]["fp32_eval"],
        "bf16_vs_fp32_value_mae_autocast_eval": mae["bf16"]["bf16_eval"] / mae["no"]["fp32_eval"],
        "steps": args.steps,
        "worst_grad_cos": after["worst_grad_cos"],
        "worst_grad_cos_before": before["worst_grad_cos"],
        "loc_Y_err_over_scale": after["loc_Y_err_over_scale"],
        **{f"gemm_{p}_loss_rel_err": gemm[p]["loss_rel_err"] for p in ("fp32", "tf32", "bf16")},
        **{f"gemm_{p}_grad_cos": gemm[p]["grad_cos"] for p in ("fp32", "tf32", "bf16")},
    }
    if not args.no_fsdp:
        result["fsdp_accelerate_wrap"] = fsdp_wrap_result()
    print("RESULT " + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
