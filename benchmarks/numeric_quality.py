"""Numeric quality on the held-out TEST splits of the offline real data sets (docs/values.md, docs/numeric_quality.md).

    python benchmarks/numeric_quality.py                        # every corpus of CORPORA, 150 steps per trained variant
    python benchmarks/numeric_quality.py --corpora sunspots --steps 240
    python benchmarks/numeric_quality.py --quick                # toy size (CI smoke test)
    python benchmarks/numeric_quality.py --ordered ...          # ACI vs split-conformal intervals (ORDERED_DOC)
    python benchmarks/numeric_quality.py --chat ...             # conversations end to end (CHAT_DOC)

Per corpus, in ONE run, on the same split by time (tabular corpora: a seeded permutation), every choice on
VALIDATION and every figure on TEST: ``constant`` (train median), ``persistence``, ``seasonal_naive``, ``linear``
(AR(p) / ridge on the prompt's numbers), ``ridge_probe`` (ridge on the frozen base's features, Cauchy intervals),
``causal_frozen`` / ``causal_lora`` (`train.train` with its defaults, frozen backbone or peft LoRA) and
``digit_lora`` (peft LoRA on digit tokens, greedy, first number parsed; ``--digit-samples`` temperature-1 samples
give its intervals). Beside quality: forwards and wall seconds per prediction. Every trained variant: the same
random tiny base (`--hidden-size`, `--layers`, `--base-seed`), steps, batch, example order, AdamW, cosine schedule
with 5% warmup, clipping 1.0. What each variant is and the figures: docs/numeric_quality.md, docs/values.md.

Columns: MAE, median AE, MAE / persistence (constant where there is no persistence), 50% and
90% coverage of the central Cauchy intervals, mean 90% width, mean Cauchy NLL. Output: the
markdown tables (``--output``, default ``numeric_quality.md``), the JSON beside it, and ONE last
line ``RESULT key=value ...`` with, per corpus, ``<c>_frozen_vs_probe``,
``<c>_lora_vs_persistence`` (or ``_vs_constant``), ``<c>_lora_vs_digit``, ``<c>_cov50``,
``<c>_cov90`` (frozen adapter) and ``<c>_lora_cov50`` / ``<c>_lora_cov90``; ``<c>_frozen_val_mae``,
``<c>_frozen_val_winkler90``; with the digit LoRA ``<c>_winkler90_vs_digit_sampled`` (also 50 and pinball;
frozen adapter / sampled digit intervals), ``<c>_digit_sample_parse_rate``, ``<c>_seconds_per_pred_causal`` /
``_digit`` and ``<c>_forwards_per_pred_causal`` / ``_digit``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from baselines import window_ar
from common import fmt, log, num_features, offline, ridge_fit, ridge_predict, shuffle_labels, write_report

CORPORA = ("sunspots", "nile", "co2", "elnino", "macro", "diabetes", "engel", "heteroscedastic")
TABULAR = ("diabetes", "engel", "heteroscedastic")  # not series: the linear baseline is ridge on the prompt's numbers
LEVELS = (0.5, 0.8, 0.9, 0.95)
PINBALL_LEVELS = tuple(round(0.05 * k, 2) for k in range(1, 20))
TRAINED = ("causal_frozen", "causal_lora", "digit_lora")
SEASON = {"co2": 12, "elnino": 12}
VARIANTS = ("constant", "persistence", "seasonal_naive", "linear", "linear_huber", "probe_raw_unit_d", "probe_std_unit_d",
            "ridge_probe", "causal_frozen", "causal_lora", "digit_lora")
LABELS = {
    "constant": "constant (train median)",
    "persistence": "persistence (last value)",
    "seasonal_naive": "seasonal naive (one season back)",
    "linear": "AR(p) least squares / ridge on the features",
    "linear_huber": "AR(p) / ridge, Huber M-estimate (IRLS)",
    "ridge_probe": "ridge probe on the frozen base's features",
    "causal_frozen": "causal adapter, frozen backbone",
    "causal_lora": "causal adapter + LoRA",
    "digit_lora": "digit-token LoRA fine-tune (greedy)",
}
#: ``--input-ablation``: the ridge probe with the seeds' input path (raw symlog values, |d| = 1)
ABLATIONS = {
    "probe_raw_unit_d": dict(standardize_inputs=False, direction_norm=1.0),
    "probe_std_unit_d": dict(standardize_inputs=True, direction_norm=1.0),
}
LABELS.update({"probe_raw_unit_d": "ridge probe, raw values in phi, |d| = 1 (the seeds')",
               "probe_std_unit_d": "ridge probe, standardised values in phi, |d| = 1"})
SCHEDULER = "cosine"
WARMUP_RATIO = 0.05
MAX_GRAD_NORM = 1.0
LORA_R, LORA_ALPHA, LORA_DROPOUT = 8, 16, 0.0
RIDGE_GRID = tuple(10.0 ** k for k in range(-8, 4))
QUICK = dict(steps=2, batch_size=4, hidden_size=16, layers=1, max_train=12, max_eval=4, corpora=("sunspots", "diabetes"),
             digit_samples=4)
DEFAULTS = dict(steps=150, batch_size=16, hidden_size=64, layers=2, max_train=None, max_eval=None, corpora=CORPORA,
                digit_samples=20)


# ----------------------------------------------------------------------------- small helpers
def _base(args):
    from causal_adapter.saving.assets import build_tiny_qwen

    return build_tiny_qwen(args.arch, hidden_size=args.hidden_size, num_layers=args.layers, seed=args.base_seed)


def input_path(args) -> dict:
    """CausalAdapterConfig overrides of ``--input-path``."""
    return dict(standardize_inputs=False, direction_norm=1.0) if args.input_path == "seeds" else {}


def score(preds, targets, scales=None, calibration=None) -> dict:
    """MAE, median AE and, with Cauchy scales: coverage of the reported intervals at `LEVELS` (calibrated
    by `calibration`, an `intervals` map, when given; raw Cauchy beside), Winkler scores at 50% / 90%,
    the mean pinball loss over 0.05..0.95, mean 90% width and mean Cauchy NLL."""
    from causal_adapter.modeling.cauchy import cauchy_nll

    y = torch.tensor([float(t) for t in targets], dtype=torch.float64)
    p = torch.tensor([float(v) for v in preds], dtype=torch.float64)
    err = (p - y).abs()
    out = {"n": len(y), "mae": float(err.mean()), "median_ae": float(err.median()), "predictions": p.tolist(),
           # |error| quantile 90% / 50%: 6.31 for Cauchy errors, 2.44 Gaussian, 3.32 Laplace
           "tail_ratio": float(torch.quantile(err, 0.9) / err.median()) if float(err.median()) > 0 else None,
           "coverage_50": None, "coverage_90": None, "width_90": None, "nll": None}
    if scales is not None:
        s = torch.tensor([float(v) for v in scales], dtype=torch.float64)
        out.update(interval_scores(y, p, s, calibration), nll=float(cauchy_nll(y, p, s).mean()), scales=s.tolist())
        out.update({f"cauchy_coverage_{round(100 * q)}": v
                    for q, v in zip(LEVELS, interval_scores(y, p, s, None, coverage_only=True))})
    return out


def interval_scores(y, loc, scale, calibration=None, coverage_only=False):
    """Coverage at `LEVELS`, Winkler 50/90, mean pinball loss and mean 90% width of the intervals
    loc -+ c_q scale (`intervals.interval`: conformal c_q with `calibration`, else Cauchy)."""
    from causal_adapter.modeling.intervals import interval

    if coverage_only:
        return [float(((y >= lo) & (y <= hi)).double().mean())
                for lo, hi in (interval(loc, scale, q, calibration) for q in LEVELS)]

    def quantile(tau: float):  # quantile tau = the edge of the central |2 tau - 1| interval (the median at 0.5)
        if tau == 0.5:
            return loc
        lo, hi = interval(loc, scale, round(abs(2 * tau - 1), 6), calibration)
        return hi if tau > 0.5 else lo
    return quantile_scores(y, quantile)


def quantile_scores(y, quantile) -> dict:
    """Coverage of the central intervals [quantile((1 - q) / 2), quantile((1 + q) / 2)] at `LEVELS`, their
    Winkler scores at 50% / 90%, the mean 90% width and the mean pinball loss over `PINBALL_LEVELS`, where
    `quantile(tau)` gives the predicted tau-quantile of every row ([n] float64)."""
    from causal_adapter.modeling.intervals import winkler

    out = {}
    for q in LEVELS:
        lo, hi = quantile(round((1 - q) / 2, 6)), quantile(round((1 + q) / 2, 6))
        out[f"coverage_{round(100 * q)}"] = float(((y >= lo) & (y <= hi)).double().mean())
        if q in (0.5, 0.9):
            out[f"winkler_{round(100 * q)}"] = float(winkler(y, lo, hi, q).mean())
        if q == 0.9:
            out["width_90"] = float((hi - lo).mean())
    losses = []
    for tau in PINBALL_LEVELS:
        d = y - quantile(tau)
        losses.append(torch.maximum(tau * d, (tau - 1) * d).mean())
    out["pinball"] = float(torch.stack(losses).mean())
    return out


def sample_quantiles(samples: list[list[float]], fallback: float):
    """`quantile(tau)` of `quantile_scores` from per-row samples: the empirical tau-quantile (linear
    interpolation, `torch.quantile`) of each row's parsed samples; a row without one is the point `fallback`."""
    rows = [torch.tensor(s if s else [fallback], dtype=torch.float64) for s in samples]

    def quantile(tau: float):
        return torch.stack([torch.quantile(r, tau) for r in rows])
    return quantile


def constwidth_scores(val: dict, test: dict, y_val, y_test) -> dict:
    """The constant-width split-conformal interval on the same point predictions: half-width c_q = the
    conformal quantile of the validation |residuals|; its Cauchy NLL uses scale = median |residual|."""
    from causal_adapter.modeling.cauchy import cauchy_nll
    from causal_adapter.modeling.intervals import fit_calibration

    yv, pv = torch.tensor(y_val, dtype=torch.float64), torch.tensor(val["predictions"], dtype=torch.float64)
    yt, pt = torch.tensor(y_test, dtype=torch.float64), torch.tensor(test["predictions"], dtype=torch.float64)
    cal = fit_calibration(yv, pv, torch.ones_like(pv))
    out = interval_scores(yt, pt, torch.ones_like(pt), cal)
    s = float((yv - pv).abs().median())
    out["nll"] = float(cauchy_nll(yt, pt, torch.full_like(pt, max(s, 1e-12))).mean())
    return out


def history(prompt: str) -> list[float]:
    """The window's values of a series prompt ("Title t1: v1; t2: v2; ...; tn:")."""
    return [float(part.rsplit(": ", 1)[1]) for part in prompt.split("; ")[:-1]]


def huber_fit(X: torch.Tensor, t: torch.Tensor, lam: float, iters: int = 50) -> torch.Tensor:
    """Huber M-estimate (IRLS, k = 1.345 robust sd, `value_head.linear.robust_weights`) of the ridge model of
    `ridge_fit`, started from its least-squares solution; w [d + 1] with the intercept last."""
    from causal_adapter.training.value_head.linear import robust_weights

    mu, sd = X.mean(0), X.std(0).clamp_min(1e-12)
    A = torch.cat([(X - mu) / sd, torch.ones(len(X), 1, dtype=X.dtype)], 1)
    D = torch.eye(A.shape[1], dtype=X.dtype)
    D[-1, -1] = 0.0  # the intercept is not penalised
    beta = torch.linalg.lstsq(A.T @ A + lam * len(X) * D, A.T @ t).solution
    for _ in range(iters):
        wts = robust_weights(t - A @ beta, "huber")
        beta = torch.linalg.lstsq(A.T @ (wts[:, None] * A) + lam * len(X) * D, A.T @ (wts * t)).solution
    w = beta[:-1] / sd
    return torch.cat([w, (beta[-1] - mu @ w).reshape(1)])


def choose_ridge(Xtr, ttr, Xva, tva, grid=RIDGE_GRID):
    """(w, lam) of the grid's penalty with the smallest validation MAE."""
    best = min(grid, key=lambda lam: float((ridge_predict(ridge_fit(Xtr, ttr, lam), Xva) - tva).abs().mean()))
    return ridge_fit(Xtr, ttr, best), best


# ----------------------------------------------------------------------------- simple predictors
def run_simple(corpus: str, splits, constant: float) -> dict:
    """constant, persistence, seasonal naive and the linear model (AR(p) / ridge on the features)."""
    from causal_adapter.numbers import find_numbers

    out = {}
    y = {k: [float(v) for v in splits[k]["target"]] for k in ("train", "validation", "test")}
    for k in ("validation", "test"):
        out.setdefault("constant", {})[k] = score([constant] * len(y[k]), y[k])
    tt = {k: torch.tensor(v, dtype=torch.float64) for k, v in y.items()}
    if corpus in TABULAR:
        feats = {k: torch.tensor([[n.value for n in find_numbers(p)] for p in splits[k]["prompt"]], dtype=torch.float64)
                 for k in ("train", "validation", "test")}
        w, lam = choose_ridge(feats["train"], tt["train"], feats["validation"], tt["validation"])
        out["linear"] = {k: score(ridge_predict(w, feats[k]).tolist(), y[k]) for k in ("validation", "test")}
        out["linear"]["choice"] = f"ridge lambda {lam:g}"
        wh = huber_fit(feats["train"], tt["train"], lam)
        out["linear_huber"] = {k: score(ridge_predict(wh, feats[k]).tolist(), y[k]) for k in ("validation", "test")}
        out["linear_huber"]["choice"] = f"ridge lambda {lam:g}"
        return out
    hist = {k: [history(p) for p in splits[k]["prompt"]] for k in ("train", "validation", "test")}
    out["persistence"] = {k: score([h[-1] for h in hist[k]], y[k]) for k in ("validation", "test")}
    season = SEASON.get(corpus)
    if season and all(len(h) >= season for h in hist["test"]):
        out["seasonal_naive"] = {k: score([h[-season] for h in hist[k]], y[k]) for k in ("validation", "test")}
    p, w, X = window_ar(hist, y, min(len(h) for h in hist["train"]))
    out["linear"] = {k: score(ridge_predict(w, X[k]).tolist(), y[k]) for k in ("validation", "test")}
    out["linear"]["choice"] = f"AR({p})"
    wh = huber_fit(X["train"], tt["train"], 0.0)
    out["linear_huber"] = {k: score(ridge_predict(wh, X[k]).tolist(), y[k]) for k in ("validation", "test")}
    out["linear_huber"]["choice"] = f"AR({p})"
    return out


# ----------------------------------------------------------------------------- ridge probe
def run_probe(args, splits, tokenizer, **input_path) -> dict:
    """Ridge on the frozen base's features (the causal adapter's loc_U at init, in its value units).
    `input_path`: CausalAdapterConfig overrides of the input side (the ``--input-ablation`` rows)."""
    from causal_adapter import CausalAdapterConfig, get_causal_model
    from causal_adapter.training.value_head.warm_start import fit_value_units

    loc, scale = fit_value_units([float(v) for v in splits["train"]["target"]])
    model = get_causal_model(_base(args), CausalAdapterConfig(seed=args.seed, value_loc=loc, value_scale=scale,
                                                              **input_path), tokenizer=tokenizer)
    feats = {k: num_features(model, splits[k], tokenizer) for k in ("train", "validation", "test")}
    t = {k: (v[1] - loc) / scale for k, v in feats.items()}
    w, lam = choose_ridge(feats["train"][0], t["train"], feats["validation"][0], t["validation"])
    pred = {k: loc + scale * ridge_predict(w, feats[k][0]) for k in feats}
    s = float((pred["validation"] - feats["validation"][1]).abs().median())
    out = {k: score(pred[k].tolist(), feats[k][1].tolist(), [s] * len(pred[k])) for k in ("validation", "test")}
    out["choice"] = f"ridge lambda {lam:g}"
    return out


# ----------------------------------------------------------------------------- causal adapters
def run_causal(args, lora: bool, splits, tokenizer, work_dir: Path) -> dict:
    """`train.train` with its defaults (validation split given: it calibrates the scale)."""
    from causal_adapter import get_causal_model
    from causal_adapter.data.pipeline import tokenize_dataset
    from causal_adapter.training.metrics import evaluate_dataset
    from causal_adapter.numbers import NumberTokenizer
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import train

    name = "causal_lora" if lora else "causal_frozen"
    config = TrainConfig(
        lora=lora, lora_r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT, lora_learning_rate=args.lora_lr,
        tiny_arch=args.arch, tiny_hidden_size=args.hidden_size, tiny_layers=args.layers,
        max_steps=args.steps, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type=SCHEDULER, warmup_ratio=WARMUP_RATIO, max_grad_norm=MAX_GRAD_NORM,
        weight_decay=0.0, add_eos_token=True, seed=args.seed, output_dir=str(work_dir / name),
        logging_steps=max(1, args.steps // 5), plot=False, progress=False, cpu=True,
        **({} if args.freeze is None else {"freeze": args.freeze}),
        **({} if args.gamma0 is None else {"gamma0": args.gamma0}),
        **({} if args.threshold_init is None else {"threshold_init": args.threshold_init}),
    )
    adapter_config = config.adapter_config()
    for k, v in input_path(args).items():
        setattr(adapter_config, k, v)
    model = get_causal_model(_base(args), adapter_config, tokenizer=tokenizer)
    t0 = time.perf_counter()
    result = train(model, config, tokenizer=tokenizer, train_dataset=splits["train"],
                   eval_dataset=splits["validation"])
    ntok = NumberTokenizer(tokenizer, result.model.num_token_id)
    cal = result.model.causal_config.value_calibration
    out = {"train_seconds": time.perf_counter() - t0, "steps": result.global_step,
           "value_units": [result.model.causal_config.value_loc, result.model.causal_config.value_scale]}
    y = {}
    for split in ("validation", "test"):
        ds = tokenize_dataset(splits[split], ntok, add_eos_token=True)
        rows_seen = []
        handle = result.model.register_forward_pre_hook(
            lambda mod, a, kw: rows_seen.append(int(kw.get("input_ids", a[0] if a else None).shape[0])),
            with_kwargs=True)
        t1 = time.perf_counter()
        try:
            m, preds = evaluate_dataset(result.model, ds, ntok.pad_token_id, batch_size=args.batch_size,
                                        return_predictions=True)
        finally:
            handle.remove()
        if m["num_targets"] != len(splits[split]):
            raise RuntimeError(f"{name}: {m['num_targets']} <NUM> targets in {split}, expected {len(splits[split])}")
        out[split] = score(preds["loc"], preds["y_true"], preds["scale"], cal)
        out[split]["num_recall"] = m.get("num_recall")
        # one teacher-forced forward per row gives the value and every interval
        out[split]["seconds_per_prediction"] = (time.perf_counter() - t1) / max(1, len(ds))
        out[split]["forwards_per_prediction"] = sum(rows_seen) / max(1, len(ds))
        y[split] = preds["y_true"]
    out["constwidth"] = constwidth_scores(out["validation"], out["test"], y["validation"], y["test"])
    return out


# ----------------------------------------------------------------------------- plain LoRA baseline
def encode_plain(dataset, tokenizer) -> list[dict]:
    """prompt and completion encoded separately with the plain tokenizer and concatenated,
    completion + EOS; labels -100 on the prompt (the same convention as `data.tokenize_dataset`)."""
    eos = tokenizer.eos_token_id
    prompts = tokenizer(list(dataset["prompt"]), add_special_tokens=False)["input_ids"]
    comps = tokenizer(list(dataset["completion"]), add_special_tokens=False)["input_ids"]
    rows = []
    for p, c in zip(prompts, comps):
        c = list(c) + [eos]
        rows.append({"prompt_ids": list(p), "input_ids": list(p) + c, "labels": [-100] * len(p) + c})
    return rows


def collate_plain(rows: list[dict], pad_id: int) -> dict:
    """Right-padded batch, plus the per-row positions whose logits predict a completion token:
    ``keep[b, j] = len(prompt_b) - 1 + j`` for j < K = max completion length + 1, and the labels
    at those positions (the model's loss shifts them by one, so position len(prompt)-1 predicts
    the first completion token). Positions past the row are clamped and get label -100."""
    S = max(len(r["input_ids"]) for r in rows)
    B = len(rows)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros((B, S), dtype=torch.long)
    labels = torch.full((B, S), -100, dtype=torch.long)
    K = max(len(r["input_ids"]) - len(r["prompt_ids"]) for r in rows) + 1
    keep = torch.zeros((B, K), dtype=torch.long)
    keep_labels = torch.full((B, K), -100, dtype=torch.long)
    for b, r in enumerate(rows):
        n, p = len(r["input_ids"]), len(r["prompt_ids"])
        ids[b, :n] = torch.tensor(r["input_ids"])
        mask[b, :n] = 1
        labels[b, :n] = torch.tensor(r["labels"])
        pos = torch.arange(p - 1, p - 1 + K)
        inside = pos < n
        keep[b] = pos.clamp(max=S - 1)
        keep_labels[b, inside] = labels[b, pos[inside]]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "keep": keep, "keep_labels": keep_labels}


def plain_loss(model, batch: dict, full: bool = False):
    """The base model's own ``labels`` cross-entropy on the completion tokens. ``full=True`` forms
    the logits of every position (reference for the test); the default keeps only the positions
    that predict a completion token (same value)."""
    if full:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"]).loss
    # the kept positions gathered here (a per-row [B, K] `logits_to_keep` is not taken by every transformers 5.x)
    hidden = model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    keep = batch["keep"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    logits = model.get_output_embeddings()(hidden.gather(1, keep)).float()  # [B, K, V]
    # as the model's own loss: position j predicts label j + 1, mean over the labelled ones
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["keep_labels"][:, 1:].flatten(),
                                             ignore_index=-100)


def build_plain_lora(args):
    from peft import LoraConfig, get_peft_model

    from causal_adapter.config import DEFAULT_LORA_TARGETS

    base = _base(args)
    torch.manual_seed(args.seed)  # LoRA A init, as for the causal adapter + LoRA
    model = get_peft_model(base, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT,
                                                   target_modules=list(DEFAULT_LORA_TARGETS), task_type="CAUSAL_LM"))
    return model


def train_plain_lora(args, model, rows: list[dict], pad_id: int) -> dict:
    """AdamW + transformers.get_scheduler (cosine, warmup), grad clipping, the example order of
    `train.train` (`EpochSampler`, seed + epoch), `args.steps` optimizer steps."""
    from transformers import get_scheduler

    from causal_adapter.training.data import EpochSampler

    torch.manual_seed(args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    warmup = math.ceil(WARMUP_RATIO * args.steps)
    sched = get_scheduler(SCHEDULER, opt, num_warmup_steps=warmup, num_training_steps=args.steps)
    sampler = EpochSampler(len(rows), 1, 0, seed=args.seed)
    model.train()
    step, epoch, losses = 0, 0, []
    t0 = time.perf_counter()
    log_every = max(1, args.steps // 10)
    while step < args.steps:
        sampler.set_epoch(epoch)
        order = list(sampler)
        for i in range(0, len(order), args.batch_size):
            if step >= args.steps:
                break
            batch = collate_plain([rows[j] for j in order[i:i + args.batch_size]], pad_id)
            loss = plain_loss(model, batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"digit-token LoRA: non-finite loss at step {step + 1}")
            loss.backward()
            if MAX_GRAD_NORM:
                torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            losses.append(loss.item())
            if step % log_every == 0 or step == args.steps:
                log(f"  digit_lora step {step}/{args.steps} loss {statistics.fmean(losses[-log_every:]):.4g}")
        epoch += 1
    model.eval()
    return {"train_seconds": time.perf_counter() - t0, "train_loss": losses[-1] if losses else None, "steps": step}


@torch.no_grad()
def generate_plain(model, rows: list[dict], tokenizer, max_new_tokens: int) -> list[str]:
    """Greedy completions, one prompt at a time (no padding), decoded without special tokens."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    texts = []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad if pad is not None else eos)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


def score_plain(texts: list[str], targets: list[float], fallback: float) -> dict:
    """First number of each text (find_numbers); a text without one is a failure predicted as `fallback`."""
    from causal_adapter.numbers import find_numbers

    preds, parsed = [], []
    for t in texts:
        nums = find_numbers(t)
        parsed.append(bool(nums))
        preds.append(nums[0].value if nums else fallback)
    ok = [abs(p - y) for p, y, k in zip(preds, targets, parsed) if k]
    return {**score(preds, targets), "parse_rate": sum(parsed) / len(parsed) if parsed else None,
            "parsed": sum(parsed), "mae_parsed_only": sum(ok) / len(ok) if ok else None, "texts": texts}


@torch.no_grad()
def sample_plain(model, rows: list[dict], tokenizer, max_new_tokens: int, n_samples: int, seed: int) -> dict:
    """`n_samples` temperature-1 completions per prompt (pure sampling: no top-k / top-p), the samples of one
    prompt in one batch; the cost: wall seconds and sequence forwards (the rows of every forward call of the
    base model, KV cache on) per prompt."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    count = {"calls": 0, "rows": 0}

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        count["calls"] += 1
        count["rows"] += int(ids.shape[0]) if ids is not None else 0
    handle = model.get_base_model().register_forward_pre_hook(hook, with_kwargs=True)
    torch.manual_seed(seed)
    texts, t0 = [], time.perf_counter()
    try:
        for r in rows:
            ids = torch.tensor([r["prompt_ids"]])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n_samples,
                                 eos_token_id=eos, pad_token_id=pad if pad is not None else eos)
            texts.append([tokenizer.decode(o[ids.shape[1]:], skip_special_tokens=True) for o in out])
    finally:
        handle.remove()
    n = max(1, len(rows))
    return {"texts": texts, "seconds_per_prediction": (time.perf_counter() - t0) / n,
            "forwards_per_prediction": count["rows"] / n, "forward_calls_per_prediction": count["calls"] / n}


def score_samples(texts: list[list[str]], targets: list[float], fallback: float) -> dict:
    """Intervals from sampled completions: each sample's first number (find_numbers); an unparsable sample is
    missing; the quantiles of a prompt's parsed samples give its intervals at every level (`sample_quantiles`;
    a prompt with none gets the point `fallback`). Winkler / pinball / coverage as for the Cauchy intervals;
    no NLL (samples define no density)."""
    from causal_adapter.numbers import find_numbers

    samples = [[nums[0].value for nums in map(find_numbers, row) if nums] for row in texts]
    total = sum(len(row) for row in texts)
    y = torch.tensor([float(t) for t in targets], dtype=torch.float64)
    out = quantile_scores(y, sample_quantiles(samples, fallback))
    out.update(n=len(y), nll=None, parse_rate=sum(map(len, samples)) / total if total else None,
               prompts_without_number=sum(1 for s in samples if not s),
               samples_per_prompt=total / len(texts) if texts else 0)
    return out


def run_plain(args, splits, tokenizer, fallback: float) -> dict:
    rows = encode_plain(splits["train"], tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = build_plain_lora(args)
    out = train_plain_lora(args, model, rows, pad_id)
    max_new = max(len(r["input_ids"]) - len(r["prompt_ids"]) for r in rows) + 4
    out["max_new_tokens"] = max_new
    for split in ("validation", "test"):
        srows = encode_plain(splits[split], tokenizer)
        t0 = time.perf_counter()
        texts = generate_plain(model, srows, tokenizer, max_new)
        out[split] = score_plain(texts, [float(v) for v in splits[split]["target"]], fallback)
        out[split]["seconds_per_prediction"] = (time.perf_counter() - t0) / max(1, len(srows))
    if args.digit_samples > 0:  # the sampled intervals, on test only
        srows = encode_plain(splits["test"], tokenizer)
        smp = sample_plain(model, srows, tokenizer, max_new, args.digit_samples, args.seed)
        out["sampled"] = {**score_samples(smp.pop("texts"), [float(v) for v in splits["test"]["target"]], fallback),
                          **smp}
    return out


# ----------------------------------------------------------------------------- report
def ref_name(results: dict) -> str:
    return "persistence" if "persistence" in results else "constant"


def format_table(corpus: str, results: dict, constant: float) -> str:
    ref = ref_name(results)
    n = results["constant"]["test"]["n"]
    lines = [f"| {corpus} TEST (n={n}) | MAE | median AE | MAE / {ref} | 50% cov | 90% cov | mean 90% width "
             "| mean NLL | validation MAE | choice |", "| --- " * 10 + "|"]
    ref_mae = results[ref]["test"]["mae"]
    for name in VARIANTS:
        if name not in results:
            continue
        r = results[name]
        t, v = r["test"], r["validation"]
        lines.append(f"| {LABELS[name]} | {fmt(t['mae'])} | {fmt(t['median_ae'])} | {fmt(t['mae'] / ref_mae, 3)} "
                     f"| {fmt(t['coverage_50'], 3)} | {fmt(t['coverage_90'], 3)} | {fmt(t['width_90'])} "
                     f"| {fmt(t['nll'])} | {fmt(v['mae'])} | {r.get('choice', '')} |")
    tails = ", ".join(f"{LABELS[k].split(',')[-1].strip()} {fmt(results[k]['test']['tail_ratio'], 3)}"
                      for k in ("causal_frozen", "causal_lora") if k in results)
    lines.append(f"\n|error| 90%/50% quantile ratio on test (Cauchy 6.31, Gaussian 2.44, Laplace 3.32): {tails}.")
    d = results.get("digit_lora")
    if d:
        lines.append(f"digit-token LoRA: {d['test']['parsed']}/{d['test']['n']} test completions held a number "
                     f"(failures predicted as the train median {constant:g}).")
    return "\n".join(lines)


def result_line(all_results: dict, args, noisy: dict | None = None) -> str:
    kv = {"steps": args.steps, "input_path": args.input_path}
    for corpus, res in all_results.items():
        ref = ref_name(res)
        t = {k: res[k]["test"] for k in res if isinstance(res[k], dict) and "test" in res[k]}
        if "causal_frozen" in t:
            f = t["causal_frozen"]
            kv[f"{corpus}_frozen_mae"] = f["mae"]
            kv[f"{corpus}_frozen_vs_probe"] = f["mae"] / t["ridge_probe"]["mae"]
            for q in LEVELS:
                kv[f"{corpus}_cov{round(100 * q)}"] = f[f"coverage_{round(100 * q)}"]
            kv[f"{corpus}_cauchy_cov90"] = f["cauchy_coverage_90"]
            cw = res["causal_frozen"]["constwidth"]
            kv[f"{corpus}_winkler90_vs_constwidth"] = f["winkler_90"] / cw["winkler_90"]
            kv[f"{corpus}_winkler50_vs_constwidth"] = f["winkler_50"] / cw["winkler_50"]
            kv[f"{corpus}_pinball_vs_constwidth"] = f["pinball"] / cw["pinball"]
            kv[f"{corpus}_nll_minus_constwidth"] = f["nll"] - cw["nll"]
            v = res["causal_frozen"]["validation"]  # item 7: the input path chosen on validation
            kv[f"{corpus}_frozen_val_mae"] = v["mae"]
            kv[f"{corpus}_frozen_val_winkler90"] = v["winkler_90"]
            kv[f"{corpus}_seconds_per_pred_causal"] = f["seconds_per_prediction"]
            kv[f"{corpus}_forwards_per_pred_causal"] = f["forwards_per_prediction"]
            smp = res.get("digit_lora", {}).get("sampled")
            if smp:
                for key in ("winkler90", "winkler50", "pinball"):
                    k = key.replace("winkler", "winkler_")
                    kv[f"{corpus}_{key}_vs_digit_sampled"] = f[k] / smp[k] if smp[k] else math.nan
            if "scale_spearman" in res["causal_frozen"]:
                kv["synthetic_scale_spearman"] = res["causal_frozen"]["scale_spearman"]
        if "causal_lora" in t:
            kv[f"{corpus}_lora_mae"] = t["causal_lora"]["mae"]
            kv[f"{corpus}_lora_vs_{ref}"] = t["causal_lora"]["mae"] / t[ref]["mae"]
            kv[f"{corpus}_lora_vs_constant"] = t["causal_lora"]["mae"] / t["constant"]["mae"]
            kv[f"{corpus}_lora_vs_linear"] = t["causal_lora"]["mae"] / t["linear"]["mae"]
            kv[f"{corpus}_lora_cov50"] = t["causal_lora"]["coverage_50"]
            kv[f"{corpus}_lora_cov90"] = t["causal_lora"]["coverage_90"]
            if "digit_lora" in t:
                kv[f"{corpus}_lora_vs_digit"] = t["causal_lora"]["mae"] / t["digit_lora"]["mae"]
        smp = res.get("digit_lora", {}).get("sampled")
        if smp:
            kv[f"{corpus}_digit_sample_parse_rate"] = smp["parse_rate"]
            kv[f"{corpus}_seconds_per_pred_digit"] = smp["seconds_per_prediction"]
            kv[f"{corpus}_forwards_per_pred_digit"] = smp["forwards_per_prediction"]
    for corpus, by_frac in (noisy or {}).items():
        clean = all_results[corpus]
        for frac, res in by_frac.items():
            tag = f"label_noise{round(100 * frac)}"
            for name in ("causal_frozen", "linear", "linear_huber"):
                if name in res and name in clean:
                    key = f"{tag}_vs_clean" if name == "causal_frozen" else f"{tag}_{name}_vs_clean"
                    key = key if corpus == "sunspots" else f"{corpus}_{key}"
                    kv[key] = res[name]["test"]["mae"] / clean[name]["test"]["mae"]
    return "RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kv.items())


def format_noise_table(all_results: dict, noisy: dict) -> str:
    """Test MAE by fraction of shuffled training labels, and the ratio to the clean run."""
    lines = []
    for corpus, by_frac in noisy.items():
        fracs = [0.0, *by_frac]
        lines += [f"| {corpus} TEST MAE, shuffled train labels | " + " | ".join(f"{round(100 * f)}%" for f in fracs)
                  + " | worst / clean |", "| --- " * (len(fracs) + 2) + "|"]
        for name in ("causal_frozen", "causal_lora", "linear", "linear_huber"):
            if name not in all_results[corpus]:
                continue
            maes = [all_results[corpus][name]["test"]["mae"]] + [by_frac[f][name]["test"]["mae"] for f in by_frac]
            lines.append(f"| {LABELS[name]} | " + " | ".join(fmt(m) for m in maes) + f" | {fmt(max(maes) / maes[0], 3)} |")
        lines.append("")
    return "\n".join(lines)


def format_interval_table(corpus: str, results: dict) -> str:
    """Interval quality on test: the adapter's per-row calibrated intervals vs a constant-width
    split-conformal interval on the same point predictions and vs the digit-token LoRA's sampled intervals,
    with the cost of each (sequence forwards and seconds per prediction), and the validation split's MAE
    and Winkler 90 (what the input path is chosen on)."""
    lines = [f"| {corpus} TEST intervals | cov 50/80/90/95 | raw Cauchy cov 50/90 | Winkler 50 | Winkler 90 | "
             "pinball | NLL | forwards / prediction | s / prediction | VALIDATION MAE | VALIDATION Winkler 90 |",
             "| --- " * 11 + "|"]
    for name in ("causal_frozen", "causal_lora"):
        if name not in results:
            continue
        t, cw, v = results[name]["test"], results[name]["constwidth"], results[name]["validation"]
        covs = "/".join(fmt(t[f"coverage_{round(100 * q)}"], 2) for q in LEVELS)
        lines.append(f"| {LABELS[name]} | {covs} | {fmt(t['cauchy_coverage_50'], 2)}/{fmt(t['cauchy_coverage_90'], 2)} "
                     f"| {fmt(t['winkler_50'])} | {fmt(t['winkler_90'])} | {fmt(t['pinball'])} | {fmt(t['nll'])} "
                     f"| {fmt(t['forwards_per_prediction'], 3)} | {fmt(t['seconds_per_prediction'], 2)} "
                     f"| {fmt(v['mae'])} | {fmt(v['winkler_90'])} |")
        covs = "/".join(fmt(cw[f"coverage_{round(100 * q)}"], 2) for q in LEVELS)
        lines.append(f"| same points, constant-width conformal | {covs} | | {fmt(cw['winkler_50'])} "
                     f"| {fmt(cw['winkler_90'])} | {fmt(cw['pinball'])} | {fmt(cw['nll'])} | | | | |")
    smp = results.get("digit_lora", {}).get("sampled")
    if smp:
        covs = "/".join(fmt(smp[f"coverage_{round(100 * q)}"], 2) for q in LEVELS)
        lines.append(f"| digit-token LoRA, quantiles of {fmt(smp['samples_per_prompt'], 3)} samples (T = 1) | {covs} "
                     f"| | {fmt(smp['winkler_50'])} | {fmt(smp['winkler_90'])} | {fmt(smp['pinball'])} "
                     f"| n/a (samples) | {fmt(smp['forwards_per_prediction'], 3)} "
                     f"| {fmt(smp['seconds_per_prediction'], 2)} | | |")
        lines.append(f"\ndigit-token LoRA samples: {fmt(100 * smp['parse_rate'], 3)}% held a number; "
                     f"{smp['prompts_without_number']}/{smp['n']} prompts had none (their interval is the point "
                     "train median). No NLL: samples give no density. Forwards = rows of the base's forward calls "
                     "(KV cache on) per prompt.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--corpora", nargs="+", default=None, choices=CORPORA, help="default: all of CORPORA (quick: 2)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of every trained variant (default 150)")
    ap.add_argument("--batch-size", type=int, default=None, help="examples per step (default 16, quick: 4)")
    ap.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of the heads and of the digit LoRA")
    ap.add_argument("--lora-lr", type=float, default=1e-3, help="learning rate of the causal adapter's LoRA weights")
    ap.add_argument("--seed", type=int, default=42, help="adapter / LoRA init and example order")
    ap.add_argument("--base-seed", type=int, default=0, help="seed of the random tiny base (build_tiny_qwen)")
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3"], help="architecture of the tiny base")
    ap.add_argument("--hidden-size", type=int, default=None, help="hidden size of the tiny base (default 64)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the tiny base (default 2)")
    ap.add_argument("--output", default="numeric_quality.md", help="markdown tables; the JSON goes beside it (.json)")
    ap.add_argument("--input-path", choices=["default", "seeds"], default="default",
                    help="'seeds': every causal adapter and the probe use the seeds' input path (raw values in "
                    "phi, |d| = 1) instead of the defaults (standardised values, |d| at the embedding scale)")
    ap.add_argument("--input-ablation", action="store_true", help="also the ridge probe with raw values in phi "
                    "and with |d| = 1 (the measurements behind standardize_inputs and direction_norm)")
    ap.add_argument("--variants", nargs="+", default=list(TRAINED), choices=TRAINED,
                    help="trained variants to run (default all; the baselines and the probe always run)")
    ap.add_argument("--label-noise", nargs="+", type=float, default=[], metavar="FRACTION",
                    help="also rerun each corpus with this fraction of the training targets shuffled (e.g. 0.2 0.4), "
                    "scored on the clean test split (the seeds' anchor experiment)")
    ap.add_argument("--gamma0", type=float, default=None, help="TrainConfig.gamma0 of the causal adapters (default: "
                    "train's, 0.1; the seeds' 10 with --gamma0 10 --threshold-init 100)")
    ap.add_argument("--threshold-init", type=float, default=None, help="TrainConfig.threshold_init (default: train's, 1)")
    ap.add_argument("--freeze", nargs="+", default=None, help="TrainConfig.freeze of the causal adapters (default: "
                    "the recipe's, abduction_loc; 'none' trains W_loc too)")
    ap.add_argument("--digit-samples", type=int, default=None, help="temperature-1 samples per test prompt of "
                    "the digit-token LoRA, whose quantiles give its intervals (default 20, quick: 4; 0: none)")
    ap.add_argument("--quick", action="store_true", help="toy size for CI: few steps, small base, few examples")
    args = ap.parse_args(argv)
    defaults = QUICK if args.quick else DEFAULTS
    for k in ("steps", "batch_size", "hidden_size", "layers", "corpora", "digit_samples"):
        if getattr(args, k) is None:
            setattr(args, k, defaults[k])
    args.max_train, args.max_eval = defaults["max_train"], defaults["max_eval"]
    for k in ("steps", "batch_size", "hidden_size", "layers"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if args.digit_samples < 0:
        ap.error("--digit-samples must be >= 0")
    if not (args.lr > 0 and args.lora_lr > 0):
        ap.error("--lr and --lora-lr must be > 0")
    return args


def scale_spearman(scales, sds) -> float:
    """Spearman rank correlation (average ranks for ties) of predicted scales and true sds."""
    def ranks(v):
        v = torch.tensor(v, dtype=torch.float64)
        order = v.argsort()
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        for u in v.unique():  # average ranks of ties
            m = v == u
            r[m] = r[m].mean()
        return r
    a, b = ranks(scales), ranks(sds)
    a, b = a - a.mean(), b - b.mean()
    return float((a @ b) / (a.norm() * b.norm()))


def run_corpus(args, corpus: str, tokenizer, work: Path, label_noise: float = 0.0) -> tuple[dict, float]:
    from causal_adapter.data.corpora import build_corpus, noise_sd
    from causal_adapter.training.metrics import train_median

    dd = build_corpus(corpus)
    splits = {k: dd[k] for k in ("train", "validation", "test")}
    if args.max_train:  # --quick: the first rows only (the split stays by time)
        splits["train"] = splits["train"].select(range(min(args.max_train, len(splits["train"]))))
    if args.max_eval:
        for k in ("validation", "test"):
            splits[k] = splits[k].select(range(min(args.max_eval, len(splits[k]))))
    if label_noise:  # training targets only: validation and test stay clean
        splits["train"] = shuffle_labels(splits["train"], label_noise, args.seed)
    constant = train_median([float(v) for v in splits["train"]["target"]])
    log(f"== {corpus}: train {len(splits['train'])}, validation {len(splits['validation'])}, "
         f"test {len(splits['test'])} rows; train median {constant:g}; shuffled labels {label_noise:g}")
    results = run_simple(corpus, splits, constant)
    results["ridge_probe"] = run_probe(args, splits, tokenizer, **input_path(args))
    if args.input_ablation:  # the input-side choices, measured with the same probe
        for name, kw in ABLATIONS.items():
            results[name] = run_probe(args, splits, tokenizer, **kw)
    for name in ("causal_frozen", "causal_lora"):
        if name not in args.variants:
            continue
        results[name] = run_causal(args, name == "causal_lora", splits, tokenizer, work / corpus)
        log(f"[{corpus} {name}] {results[name]['train_seconds']:.0f} s, test MAE {fmt(results[name]['test']['mae'])}, "
             f"validation MAE {fmt(results[name]['validation']['mae'])}")
        if corpus == "heteroscedastic":
            sds = [noise_sd(p) for p in splits["test"]["prompt"]]
            results[name]["scale_spearman"] = scale_spearman(results[name]["test"]["scales"], sds)
    if "digit_lora" in args.variants:
        results["digit_lora"] = run_plain(args, splits, tokenizer, constant)
        log(f"[{corpus} digit_lora] {results['digit_lora']['train_seconds']:.0f} s, "
             f"test MAE {fmt(results['digit_lora']['test']['mae'])}")
    return results, constant



# ----------------------------------------------------------------------------- --ordered
ORDERED_DOC = """Intervals on ordered data (docs/predict.md, "Ordered data"): the CLI's default recipe, then `predict --targets-column`.

    python benchmarks/numeric_quality.py --ordered --corpora co2 sunspots macro elnino --max-steps 300

Per corpus, through the commands a user runs (`causal-adapter data`, `train --train-file --validation-file
--max-steps N`, `predict`): the adapter's split-conformal intervals (no targets), the adaptive conformal ones
(`--targets-column target`, modeling/adaptive.py) and, on the same points, a constant-width split-conformal
interval (half-width = the conformal quantile of the validation |residuals|, the baseline).

The ACI step size is chosen on VALIDATION only, one for all the corpora (`choose_gamma`): per corpus the map
is fitted on the first half of the validation rows and ACI run on the second half, in order, for each gamma
of `--gammas`. The TEST figures use the adapter's own map (fitted on all the validation rows) and that gamma
(or `--gamma`). Last line: ``RESULT key=value ...``.
"""

ORDERED_LEVELS = (0.5, 0.9)


def _pred_rows(path: Path) -> dict:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {k: torch.tensor([r[k] for r in rows], dtype=torch.float64) for k in ("target", "value", "scale")}


def aci_scores(y, lo, hi, level) -> dict:
    from causal_adapter.modeling.intervals import winkler

    return {"cov": float(((y >= lo) & (y <= hi)).double().mean()), "winkler": float(winkler(y, lo, hi, level).mean())}


def constant_width(val: dict, test: dict, level: float) -> tuple:
    from causal_adapter.modeling.intervals import conformal_multiplier, fit_calibration

    cal = fit_calibration(val["target"], val["value"], torch.ones_like(val["value"]))
    c = conformal_multiplier(cal, level)
    return test["value"] - c, test["value"] + c


def validation_table(val: dict, gammas) -> dict:
    """{gamma: {level: scores}} of ACI on the second half of the validation rows, in order (map: the first half)."""
    from causal_adapter.modeling.adaptive import adaptive_interval
    from causal_adapter.modeling.intervals import fit_calibration

    h = len(val["target"]) // 2
    first = {k: v[:h] for k, v in val.items()}
    second = {k: v[h:] for k, v in val.items()}
    cal = fit_calibration(first["target"], first["value"], first["scale"])
    return {g: {q: aci_scores(second["target"], *adaptive_interval(second["target"], second["value"], second["scale"],
                                                               q, cal, gamma=g), q) for q in ORDERED_LEVELS}
            for g in gammas}


def choose_gamma(tables: dict) -> tuple[float, dict]:
    """One gamma for all corpora from their validation tables: the smallest mean over corpora of
    (Winkler 50 + Winkler 90) / the same at the smallest gamma of the grid. The interval score is proper (its
    expectation is smallest at the true quantiles), so it already charges a gamma for missing coverage; a
    coverage filter on these halves (10 to 54 rows: a 50% coverage has a binomial sd of 0.07 to 0.16) would
    choose on noise. Returns (gamma, {gamma: that mean})."""
    gammas = sorted(next(iter(tables.values())))
    wsum = lambda t, g: sum(t[g][q]["winkler"] for q in ORDERED_LEVELS)  # noqa: E731
    crit = {g: sum(wsum(t, g) / wsum(t, gammas[0]) for t in tables.values()) / len(tables) for g in gammas}
    return min(gammas, key=crit.get), crit


def ordered_corpus(corpus: str, args, work: Path) -> dict:
    """Train (the CLI's default recipe; reused when `work` holds the run) and predict; returns
    {"validation": rows, "test": rows, "calibration": the adapter's map}."""
    from causal_adapter.commands.main import main
    from causal_adapter.saving.artifacts import CONFIG_NAME

    data = work / "data"
    main(["data", corpus, str(data)])
    out = work / f"run_{corpus}"
    if not (out / "adapter").is_dir():  # a finished run in --work-dir is reused
        main(["train", "--train-file", str(data / f"{corpus}_train.jsonl"), "--validation-file",
              str(data / f"{corpus}_validation.jsonl"), "--max-steps", str(args.max_steps), "--output-dir", str(out),
              "--no-plot", *args.train_args])
    adapter = str(out / "adapter")
    preds = {}
    for split in ("validation", "test"):
        f = work / f"{corpus}_{split}_pred.jsonl"
        main(["predict", adapter, "--data-file", str(data / f"{corpus}_{split}.jsonl"), "--output", str(f),
              "--targets-column", "target"])  # the file's value / scale; the intervals are recomputed here
        preds[split] = _pred_rows(f)
    preds["calibration"] = json.loads((Path(adapter) / CONFIG_NAME).read_text())["adapter_config"]["value_calibration"]
    return preds


def test_scores(p: dict, gamma: float) -> dict:
    from causal_adapter.modeling.adaptive import adaptive_interval
    from causal_adapter.modeling.intervals import interval

    val, test, cal = p["validation"], p["test"], p["calibration"]
    y, res = test["target"], {"mae": float((test["target"] - test["value"]).abs().mean()), "n_test": len(test["target"])}
    for q in ORDERED_LEVELS:
        res[f"split_{q}"] = aci_scores(y, *interval(test["value"], test["scale"], q, cal), q)
        res[f"aci_{q}"] = aci_scores(y, *adaptive_interval(y, test["value"], test["scale"], q, cal, gamma=gamma), q)
        res[f"constwidth_{q}"] = aci_scores(y, *constant_width(val, test, q), q)
    return res


def ordered_main(argv=None) -> int:
    from causal_adapter.modeling.adaptive import DEFAULT_GAMMA

    ap = argparse.ArgumentParser(description=ORDERED_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ordered", action="store_true")
    ap.add_argument("--corpora", nargs="+", default=["co2", "sunspots", "macro", "elnino"])
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--gammas", nargs="+", type=float, default=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5])
    ap.add_argument("--gamma", type=float, default=None, help="test gamma (default: the one chosen on validation)")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--train-args", nargs=argparse.REMAINDER, default=[], help="more `train` flags (last)")
    args = ap.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ordered_intervals_"))
    work.mkdir(parents=True, exist_ok=True)
    preds = {c: ordered_corpus(c, args, work) for c in args.corpora}
    tables = {c: validation_table(p["validation"], args.gammas) for c, p in preds.items()}
    g_val, crit = choose_gamma(tables)
    gamma = args.gamma if args.gamma is not None else g_val
    print(json.dumps({"validation": {c: {str(g): {str(q): v for q, v in t[g].items()} for g in t} for c, t in tables.items()},
                      "criterion": crit, "gamma_chosen_on_validation": g_val, "default_gamma": DEFAULT_GAMMA}, indent=1))
    kv = {"gamma_val": g_val, "gamma_test": gamma}
    for corpus, p in preds.items():
        r = test_scores(p, gamma)
        kv[f"{corpus}_n_test"] = r["n_test"]
        for q in ORDERED_LEVELS:
            n = round(100 * q)
            for kind in ("split", "aci", "constwidth"):
                kv[f"{corpus}_{kind}_cov{n}"] = round(r[f"{kind}_{q}"]["cov"], 3)
            for kind in ("split", "aci"):
                kv[f"{corpus}_{kind}_winkler{n}_vs_constwidth"] = round(r[f"{kind}_{q}"]["winkler"]
                                                                       / r[f"constwidth_{q}"]["winkler"], 3)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in kv.items()))
    return 0


# ----------------------------------------------------------------------------- --chat
CHAT_DOC = """Conversations end to end (docs/chat.md): `causal-adapter train` on a ``messages`` file, then `causal-adapter predict`
on the test conversations, against least squares on the prompt's numbers.

    python benchmarks/numeric_quality.py --chat                           # the bundled chat corpus, 200 steps
    python benchmarks/numeric_quality.py --chat --series sunspots --steps 300
    python benchmarks/numeric_quality.py --chat --quick                   # toy size (a smoke run)

Every choice is made on the VALIDATION split, every figure is reported on the TEST split:

* ``causal``: the CLI as a user runs it (`train` with its defaults on chat_train.jsonl / chat_validation.jsonl,
  `predict` on chat_test.jsonl): the value where the last assistant reply's first number stands, its
  calibrated 50% / 90% intervals.
* ``least_squares``: ordinary least squares with intercept on the K numbers just before that position in the
  conversation (the prompt's numbers: the window's years and values, the earlier replies), K chosen on
  validation among 1, 2, 4, 8, 16, 32 (rows with fewer numbers repeat their first).
* ``persistence``: the value of the step before (the corpus's ``previous``); ``constant``: the train median.

Prints one table and a RESULT line: the causal MAE as a ratio of least squares' (below 1 = better), and the
coverages.
"""

CLI = [sys.executable, "-m", "causal_adapter"]
K_CHOICES = (1, 2, 4, 8, 16, 32)


def write_corpus(out: Path, series: list[str] | None) -> dict[str, Path]:
    from causal_adapter.data.corpora import chat_corpus

    dd = chat_corpus(**({"series": series} if series else {}))
    paths = {}
    for split, ds in dd.items():
        paths[split] = out / f"chat_{split}.jsonl"
        ds.to_json(str(paths[split]), lines=True)
    return paths


def prompt_numbers(messages: list[dict]) -> list[float]:
    """The numbers before the last reply's first number, in order (user, system and earlier assistant turns,
    then the reply's text before its first number)."""
    from causal_adapter.numbers import find_numbers

    out = []
    for m in messages[:-1]:
        out += [n.value for n in find_numbers(m["content"])]
    reply = messages[-1]["content"]
    first = find_numbers(reply)
    lead = reply[:first[0].start] if first else reply
    return out + [n.value for n in find_numbers(lead)]


def features(rows: list[dict], k: int) -> np.ndarray:
    X = np.zeros((len(rows), k + 1))
    for i, r in enumerate(rows):
        nums = prompt_numbers(r["messages"]) or [0.0]
        last = nums[-k:]
        last = [last[0]] * (k - len(last)) + last
        X[i, :k], X[i, k] = last, 1.0
    return X


def least_squares(train: list[dict], val: list[dict], test: list[dict]) -> tuple[int, np.ndarray]:
    """(K chosen on validation, test predictions)."""
    y_tr, y_va = np.array([r["target"] for r in train]), np.array([r["target"] for r in val])
    best = None
    for k in K_CHOICES:
        coef = np.linalg.lstsq(features(train, k), y_tr, rcond=None)[0]
        mae = float(np.mean(np.abs(features(val, k) @ coef - y_va)))
        if best is None or mae < best[0]:
            best = (mae, k, coef)
    _, k, coef = best
    return k, features(test, k) @ coef


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_cli(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:5])}... failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def chat_main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=CHAT_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--series", nargs="*", default=None, help="chat corpus series (default: all)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="toy size: 4 steps on sunspots")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--adapter", type=Path, default=None,
                    help="an adapter `train` already made on OUT's files (OUT/chat_*.jsonl): skip training")
    args = ap.parse_args(argv)
    if args.quick:
        args.series, args.steps = args.series or ["sunspots"], 4
    out = args.out or Path(tempfile.mkdtemp(prefix="chat_quality_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.adapter is None:
        paths = write_corpus(out, args.series)
        t_train = run_cli(CLI + ["train", "--train-file", str(paths["train"]), "--validation-file",
                             str(paths["validation"]), "--output-dir", str(out / "run"), "--max-steps", str(args.steps),
                             "--no-progress", "--no-plot", "--overwrite"])
    else:
        paths, t_train = {s: out / f"chat_{s}.jsonl" for s in ("train", "validation", "test")}, float("nan")
    adapter = args.adapter or out / "run" / "adapter"
    t_pred = run_cli(CLI + ["predict", str(adapter), "--data-file", str(paths["test"]),
                        "--output", str(out / "pred.jsonl")])
    train, val, test = (read_jsonl(paths[s]) for s in ("train", "validation", "test"))
    pred = {r["row"]: r for r in read_jsonl(out / "pred.jsonl")}
    y = np.array([r["target"] for r in test])
    causal = np.array([pred[i]["value"] for i in range(len(test))])
    k, ls = least_squares(train, val, test)
    persistence = np.array([r["previous"] for r in test])
    constant = np.full_like(y, statistics.median(r["target"] for r in train))
    cover = {q: float(np.mean([(pred[i][f"lower_{q}"] <= t <= pred[i][f"upper_{q}"]) for i, t in enumerate(y)]))
             for q in ("50", "90")}
    mae = {name: float(np.mean(np.abs(p - y))) for name, p in
           (("causal", causal), ("least_squares", ls), ("persistence", persistence), ("constant", constant))}
    print(f"chat corpus ({', '.join(args.series) if args.series else 'all series'}): train {len(train)}, "
          f"validation {len(val)}, test {len(test)} conversations; {args.steps} steps ({t_train:.0f} s), "
          f"predict {t_pred:.0f} s")
    print("| method | test MAE | 50% coverage | 90% coverage |\n| --- | --- | --- | --- |")
    print(f"| causal (CLI train + predict) | {mae['causal']:.4g} | {cover['50']:.3f} | {cover['90']:.3f} |")
    print(f"| least squares on the prompt's last {k} numbers (K chosen on validation) | {mae['least_squares']:.4g} | | |")
    print(f"| persistence | {mae['persistence']:.4g} | | |\n| constant (train median) | {mae['constant']:.4g} | | |")
    per_series = {}
    for s in sorted({r["series"] for r in test}):
        idx = [i for i, r in enumerate(test) if r["series"] == s]
        per_series[s] = (float(np.mean(np.abs(causal[idx] - y[idx]))), float(np.mean(np.abs(ls[idx] - y[idx]))))
    if len(per_series) > 1:
        print("per series (causal / least squares MAE): " + ", ".join(f"{s} {a:.4g} / {b:.4g}"
                                                                         for s, (a, b) in per_series.items()))
    print(f"RESULT chat_quality causal_mae/least_squares_mae={mae['causal'] / mae['least_squares']:.3f} "
          f"coverage50={cover['50']:.3f} coverage90={cover['90']:.3f} (test, {len(test)} conversations)")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--ordered" in argv:
        return ordered_main(argv)
    if "--chat" in argv:
        return chat_main(argv)
    args = parse_args(argv)
    offline()
    from causal_adapter.saving.assets import load_qwen_tokenizer

    t0 = time.perf_counter()
    tokenizer = load_qwen_tokenizer()
    all_results, tables = {}, []
    noisy: dict = {}
    with tempfile.TemporaryDirectory(prefix="numeric_quality_") as tmp:
        for corpus in args.corpora:
            results, constant = run_corpus(args, corpus, tokenizer, Path(tmp))
            all_results[corpus] = results
            tables.append(format_table(corpus, results, constant))
            tables.append(format_interval_table(corpus, results))
            # this corpus's figures now (a long run that is stopped keeps the corpora it finished)
            log("\n".join(tables[-2:]) + f"\n[{corpus} done] " + result_line({corpus: results}, args)[len("RESULT "):])
            for frac in args.label_noise:
                if frac > 0:
                    noisy.setdefault(corpus, {})[frac] = run_corpus(args, corpus, tokenizer, Path(tmp) / f"noise{frac}",
                                                                     label_noise=frac)[0]
    if noisy:
        tables.append(format_noise_table(all_results, noisy))
    note = (f"Base: random-weight tiny {args.arch} (hidden {args.hidden_size}, {args.layers} layers, real 151,936-row "
            f"vocabulary, seed {args.base_seed}); {args.steps} steps, batch {args.batch_size}, lr {args.lr:g} "
            f"(LoRA lr {args.lora_lr:g}), seed {args.seed}. Test split only for the figures; choices on validation.")
    text = "\n\n".join(tables + [note])
    line = result_line(all_results, args, noisy)
    seconds = time.perf_counter() - t0
    write_report(Path(args.output), text, line, seconds, {"settings": vars(args), "results": all_results,
                                                          "label_noise": noisy})
    return 0


if __name__ == "__main__":
    sys.exit(main())
