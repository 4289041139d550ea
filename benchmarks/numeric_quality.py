"""Numeric quality on the held-out TEST split of an offline real series (issue 7).

    python benchmarks/numeric_quality.py                       # sunspots, 240 steps: ~2-3 min on 2 idle cores
    python benchmarks/numeric_quality.py --corpus nile --steps 120
    python benchmarks/numeric_quality.py --quick               # toy size (CI smoke test)

Variants, all on the SAME base (a fresh `assets.build_tiny_qwen` with `--base-seed` for each),
the same training rows (the train split, prompt/completion, completion + EOS), the same number
of optimizer steps, batch size, example order (`train.EpochSampler`, seed `--seed`), AdamW,
learning rate, schedule (cosine, 5% warmup) and gradient clipping (1.0):

* ``causal_frozen``: the causal adapter on a frozen backbone (`train.train`, TrainConfig(lora=False)).
* ``causal_lora``:   the causal adapter with peft LoRA on the backbone (TrainConfig(lora=True), r 8, alpha 16).
* ``plain_lora``:    what a user would otherwise pick: peft ``get_peft_model(base, LoraConfig(...))``
  with the same LoRA settings, the plain Qwen tokenizer (numbers written as digit tokens), the
  base model's own cross-entropy ``labels`` loss on the completion tokens only, a plain torch loop.
  Only the logits of the positions that predict a completion token are formed (``logits_to_keep``
  with per-row positions and the matching labels): the same loss value as labels on the full
  sequence, without a [B, S, 151936] logits tensor.
* ``constant``: the median of the train targets. ``persistence``: the previous value of the series.

Evaluation on the test split (and, reported beside it, the validation split):

* causal adapters: `metrics.evaluate_dataset`: value = loc_Y at the ``<NUM>`` target from a
  teacher-forced forward (the deterministic mode's value), plus the share of targets inside the
  central 50% / 90% intervals of Cauchy(loc_Y, scale_Y). The format (prompt ending in ``YEAR:``
  and a ``<NUM>`` label) is given; whether the adapter would choose ``<NUM>`` itself is its
  ``<NUM>`` recall, reported in the .json.
* plain LoRA: greedy ``generate`` from the prompt with the base tokenizer (up to the longest
  train completion + 4 tokens, stops at EOS), decoded, first number parsed with
  `numbers.find_numbers`. No number = a parse failure (the parse rate is reported); its MAE then
  uses the train median as the prediction for the failures (stated in the table).

The base is a random-weight model (no real Qwen weights offline): nothing here is expected to
beat persistence, and the numbers are reported as measured. Nothing is tuned on the test split.

Run time of the default (240 steps) on 2 CPU cores: 130 s when the cores are idle; 20 min when
other jobs compete for them (torch's threads slow down far more than the load suggests).

Output: a markdown table (printed and written to ``--output``, default ``numeric_quality.md``),
the same data as JSON beside it (``.json``), and ONE last line ``RESULT key=value ...`` (MAEs of
each variant and their ratios to the persistence MAE).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = ("causal_frozen", "causal_lora", "plain_lora", "constant", "persistence")
LABELS = {
    "causal_frozen": "causal adapter, frozen backbone (loc_Y)",
    "causal_lora": "causal adapter + LoRA (loc_Y)",
    "plain_lora": "plain LoRA CE fine-tune, digits (greedy generate)",
    "constant": "constant (train median)",
    "persistence": "persistence (previous value)",
}
SCHEDULER = "cosine"
WARMUP_RATIO = 0.05
MAX_GRAD_NORM = 1.0
LORA_R, LORA_ALPHA, LORA_DROPOUT = 8, 16, 0.0
QUICK = dict(steps=2, batch_size=4, hidden_size=16, layers=1, max_train=8, max_eval=3)
DEFAULTS = dict(steps=240, batch_size=16, hidden_size=64, layers=2, max_train=None, max_eval=None)


# ----------------------------------------------------------------------------- small helpers
def _mae(errors):
    return sum(errors) / len(errors) if errors else None


def _median(errors):
    return float(statistics.median(errors)) if errors else None


def _std(values):
    return float(statistics.pstdev(values)) if values else None


def _fmt(v, digits=4):
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}g}"


def _base(args):
    from causal_adapter.assets import build_tiny_qwen

    return build_tiny_qwen(args.arch, hidden_size=args.hidden_size, num_layers=args.layers, seed=args.base_seed)


def _log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- causal adapters
def run_causal(args, lora: bool, splits, tokenizer, train_targets, work_dir: Path) -> dict:
    """Train a causal adapter with `train.train` and evaluate it on validation and test."""
    from causal_adapter import get_causal_model
    from causal_adapter.data import tokenize_dataset
    from causal_adapter.metrics import evaluate_dataset
    from causal_adapter.numbers import NumberTokenizer
    from causal_adapter.train import TrainConfig, train

    name = "causal_lora" if lora else "causal_frozen"
    config = TrainConfig(
        lora=lora, lora_r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT,
        tiny_arch=args.arch, tiny_hidden_size=args.hidden_size, tiny_layers=args.layers,
        max_steps=args.steps, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type=SCHEDULER, warmup_ratio=WARMUP_RATIO, max_grad_norm=MAX_GRAD_NORM,
        weight_decay=0.0, add_eos_token=True, seed=args.seed, output_dir=str(work_dir / name),
        logging_steps=max(1, args.steps // 10), plot=False, progress=False, cpu=True,
    )
    base = _base(args)
    # get_causal_model seeds its heads from config.seed, but peft draws the LoRA A matrices from the
    # global RNG: seed it here, as build_plain_lora does for the plain LoRA baseline
    torch.manual_seed(args.seed)
    model = get_causal_model(base, config.adapter_config(), tokenizer=tokenizer)
    t0 = time.perf_counter()
    # no evaluation inside train(): validation and test are evaluated below, the same way
    result = train(model, config, tokenizer=tokenizer, train_dataset=splits["train"], eval_dataset=None,
                   train_targets=train_targets)
    train_s = time.perf_counter() - t0
    ntok = NumberTokenizer(tokenizer, result.model.num_token_id)
    out = {"train_seconds": train_s, "train_loss": result.train_loss, "steps": result.global_step}
    for split in ("validation", "test"):
        ds = tokenize_dataset(splits[split], ntok, add_eos_token=True)
        m, preds = evaluate_dataset(result.model, ds, ntok.pad_token_id, batch_size=args.batch_size,
                                    train_targets=train_targets, return_predictions=True)
        errors = [abs(p - y) for p, y in zip(preds["loc"], preds["y_true"])]
        out[split] = {
            "n": len(errors), "mae": m["value_mae"], "median_ae": m["value_median_ae"],
            "coverage_50": m.get("coverage_50"), "coverage_90": m.get("coverage_90"),
            "num_recall": m.get("num_recall"), "num_precision": m.get("num_precision"), "accuracy": m.get("accuracy"),
            "loss_reg": m.get("loss_reg"), "predictions": preds["loc"], "scales": preds["scale"],
            "max_abs_error": max(errors) if errors else None,
        }
        if m["num_targets"] != len(splits[split]):
            raise RuntimeError(f"{name}: {m['num_targets']} <NUM> targets in the {split} split, "
                               f"expected one per row ({len(splits[split])})")
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
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 labels=batch["keep_labels"], logits_to_keep=batch["keep"]).loss


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

    from causal_adapter.train import EpochSampler

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
                raise FloatingPointError(f"plain LoRA: non-finite loss at step {step + 1}")
            loss.backward()
            if MAX_GRAD_NORM:
                torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            losses.append(loss.item())
            if step % log_every == 0 or step == args.steps:
                _log(f"  plain_lora step {step}/{args.steps} loss {statistics.fmean(losses[-log_every:]):.4g}")
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
    errors = [abs(p - y) for p, y in zip(preds, targets)]
    ok = [e for e, k in zip(errors, parsed) if k]
    return {"n": len(texts), "mae": _mae(errors), "median_ae": _median(errors),
            "parse_rate": sum(parsed) / len(parsed) if parsed else None, "parsed": sum(parsed),
            "mae_parsed_only": _mae(ok), "predictions": preds, "texts": texts,
            "max_abs_error": max(errors) if errors else None}


def run_plain(args, splits, tokenizer, fallback: float) -> dict:
    rows = encode_plain(splits["train"], tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = build_plain_lora(args)
    out = train_plain_lora(args, model, rows, pad_id)
    max_new = max(len(r["input_ids"]) - len(r["prompt_ids"]) for r in rows) + 4
    out["max_new_tokens"] = max_new
    for split in ("validation", "test"):
        srows = encode_plain(splits[split], tokenizer)
        texts = generate_plain(model, srows, tokenizer, max_new)
        out[split] = score_plain(texts, [float(v) for v in splits[split]["target"]], fallback)
    return out


# ----------------------------------------------------------------------------- simple predictors
def run_simple(splits, constant: float) -> dict:
    out = {"constant": {}, "persistence": {}}
    for split in ("validation", "test"):
        y = [float(v) for v in splits[split]["target"]]
        prev = [float(v) for v in splits[split]["previous"]]
        for name, preds in (("constant", [constant] * len(y)), ("persistence", prev)):
            errors = [abs(p - t) for p, t in zip(preds, y)]
            out[name][split] = {"n": len(y), "mae": _mae(errors), "median_ae": _median(errors),
                                "max_abs_error": max(errors) if errors else None, "predictions": preds}
    return out


# ----------------------------------------------------------------------------- report
def format_table(results: dict, args, constant: float) -> str:
    pers = results["persistence"]["test"]["mae"]
    head = (f"| {args.corpus} TEST split (n={results['persistence']['test']['n']}) | MAE | median AE "
            "| MAE / persistence | 50% coverage | 90% coverage | parse rate | std of predictions | validation MAE |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in VARIANTS:
        r = results[name]
        t, v = r["test"], r["validation"]
        ratio = t["mae"] / pers if (t["mae"] is not None and pers) else None
        lines.append(f"| {LABELS[name]} | {_fmt(t['mae'])} | {_fmt(t['median_ae'])} | {_fmt(ratio, 3)} | "
                     f"{_fmt(t.get('coverage_50'), 3)} | {_fmt(t.get('coverage_90'), 3)} | "
                     f"{_fmt(t.get('parse_rate'), 3)} | {_fmt(_std(t['predictions']))} | {_fmt(v['mae'])} |")
    p = results["plain_lora"]["test"]
    top_text, top_count = collections.Counter(p["texts"]).most_common(1)[0] if p["texts"] else ("", 0)
    scales = {k: _median(results[k]["test"]["scales"]) for k in ("causal_frozen", "causal_lora")}
    notes = [
        "",
        f"Base: random-weight tiny {args.arch} (hidden {args.hidden_size}, {args.layers} layers, real 151,936-row "
        f"vocabulary, seed {args.base_seed}), no real Qwen weights. Same base, data (train split, completion + EOS), "
        f"{args.steps} steps, batch {args.batch_size}, lr {args.lr:g} ({SCHEDULER}, {WARMUP_RATIO:.0%} warmup, "
        f"clip {MAX_GRAD_NORM:g}), seed {args.seed} for every trained variant; LoRA r {LORA_R}, alpha {LORA_ALPHA}.",
        "Causal adapters: value = loc_Y at the <NUM> target of a teacher-forced forward (deterministic-mode value); "
        "coverage = share of targets inside the central 50% / 90% interval of Cauchy(loc_Y, scale_Y); "
        f"median scale_Y on the test split: {_fmt(scales['causal_frozen'])} (frozen), "
        f"{_fmt(scales['causal_lora'])} (LoRA).",
        f"Plain LoRA: greedy generation, first number parsed; {p['parsed']}/{p['n']} test completions held a number; "
        f"the failures are predicted as the train median ({constant:g}) in its MAE"
        + (f" (MAE over the parsed ones only: {_fmt(p['mae_parsed_only'])})." if p["parsed"] else ".")
        + f" Most frequent completion ({top_count}/{p['n']}): {top_text[:60]!r}.",
        "std of predictions: population standard deviation of the test predictions (0 = one value for every row).",
        "Validation MAE: the same models on the validation split (nothing was tuned on the test split).",
    ]
    return "\n".join(lines + notes)


def result_line(results: dict, args) -> str:
    pers = results["persistence"]["test"]["mae"]
    kv = {"steps": args.steps}
    for name in VARIANTS:
        kv[f"{name}_mae"] = results[name]["test"]["mae"]
    for name in VARIANTS[:-1]:
        m = results[name]["test"]["mae"]
        kv[f"{name}_ratio"] = m / pers if (m is not None and pers) else float("nan")
    kv["plain_lora_parse_rate"] = results["plain_lora"]["test"]["parse_rate"]
    kv["causal_frozen_cov90"] = results["causal_frozen"]["test"]["coverage_90"]
    kv["causal_lora_cov90"] = results["causal_lora"]["test"]["coverage_90"]
    return "RESULT " + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in kv.items())


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="sunspots", help="built-in offline corpus (sunspots, nile, co2, macro, ...)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of every trained variant (default 240, "
                    "quick: 2)")
    ap.add_argument("--batch-size", type=int, default=None, help="examples per step (default 16, quick: 4)")
    ap.add_argument("--lr", type=float, default=2e-2, help="peak learning rate of every trained variant")
    ap.add_argument("--seed", type=int, default=42, help="adapter / LoRA init and example order")
    ap.add_argument("--base-seed", type=int, default=0, help="seed of the random tiny base (build_tiny_qwen)")
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3"], help="architecture of the tiny base")
    ap.add_argument("--hidden-size", type=int, default=None,
                    help="hidden size of the tiny base (default 64, quick: 16)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the tiny base (default 2, quick: 1)")
    ap.add_argument("--output", default="numeric_quality.md", help="markdown table; the JSON goes beside it (.json)")
    ap.add_argument("--work-dir", default=None, help="where the causal adapters' training output goes "
                    "(default: a temporary directory, removed at the end)")
    ap.add_argument("--quick", action="store_true", help="toy size for CI: few steps, small base, few examples")
    args = ap.parse_args(argv)
    defaults = QUICK if args.quick else DEFAULTS
    for k in ("steps", "batch_size", "hidden_size", "layers"):
        if getattr(args, k) is None:
            setattr(args, k, defaults[k])
    args.max_train, args.max_eval = defaults["max_train"], defaults["max_eval"]
    for k in ("steps", "batch_size", "hidden_size", "layers"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if not args.lr > 0:
        ap.error("--lr must be > 0")
    return args


def run(args) -> dict:
    """Everything; returns the JSON-able results (also written next to ``args.output``)."""
    from causal_adapter.assets import load_qwen_tokenizer
    from causal_adapter.corpora import build_corpus
    from causal_adapter.metrics import train_median

    t0 = time.perf_counter()
    dd = build_corpus(args.corpus)
    splits = {"train": dd["train"], "validation": dd["validation"], "test": dd["test"]}
    if args.max_train:  # --quick: the first rows only (the split stays by time)
        splits["train"] = splits["train"].select(range(min(args.max_train, len(splits["train"]))))
    if args.max_eval:
        for k in ("validation", "test"):
            splits[k] = splits[k].select(range(min(args.max_eval, len(splits[k]))))
    tokenizer = load_qwen_tokenizer()
    train_targets = [float(v) for v in splits["train"]["target"]]
    constant = train_median(train_targets)
    _log(f"{args.corpus}: train {len(splits['train'])}, validation {len(splits['validation'])}, "
         f"test {len(splits['test'])} rows; train median {constant:g}")

    results = run_simple(splits, constant)
    tmp = None
    if args.work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="numeric_quality_")
        work = Path(tmp.name)
    else:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
    try:
        for lora in (False, True):
            name = "causal_lora" if lora else "causal_frozen"
            _log(f"[{name}] training {args.steps} steps ...")
            results[name] = run_causal(args, lora, splits, tokenizer, train_targets, work)
            _log(f"[{name}] {results[name]['train_seconds']:.0f} s, test MAE {_fmt(results[name]['test']['mae'])}")
        _log(f"[plain_lora] training {args.steps} steps ...")
        results["plain_lora"] = run_plain(args, splits, tokenizer, constant)
        plain = results["plain_lora"]
        _log(f"[plain_lora] {plain['train_seconds']:.0f} s, test MAE {_fmt(plain['test']['mae'])}, "
             f"parse rate {_fmt(plain['test']['parse_rate'])}")
    finally:
        if tmp is not None:
            tmp.cleanup()

    table = format_table(results, args, constant)
    summary = {
        "settings": {k: v for k, v in vars(args).items()},
        "train_median": constant,
        "test_targets": [float(v) for v in splits["test"]["target"]],
        "results": results,
        "table": table,
        "seconds": time.perf_counter() - t0,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    summary["result_line"] = result_line(results, args)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    summary = run(args)
    print()
    print(summary["table"])
    print(f"\ntable: {args.output}  json: {Path(args.output).with_suffix('.json')}  "
          f"time: {summary['seconds']:.0f} s")
    print(summary["result_line"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
