"""Training throughput with packed rows against padded batches, on a mixed-length conversational corpus.

    python benchmarks/packing.py                      # the bundled "chat" corpus, 4 layers of the Qwen2.5-0.5B shape
    python benchmarks/packing.py --corpus sunspots    # mixed-length rows from sunspots windows of 4-64 years

Both modes train the SAME rows for one epoch with the SAME tokens carrying the loss (checked before timing: the
summed token loss and regression loss over the epoch agree to float32 rounding at equal weights), so tokens/s
compare work done, not work skipped:

* ``padded``: batches of --batch rows in a random order, each padded on the right to its longest row
  (`NumericCollator`: what `causal-adapter train` does without --packing);
* ``packed``: the rows packed best-fit-decreasing into rows of --max-length tokens (`data.packing.pack_dataset`),
  batches of --packed-batch packed rows (`PackedCollator`: what ``--packing`` does): no padding computed but a
  packed row's tail, attention only within each original row. 4 x 512 positions a step at most, against the
  padded batch's 8 x its longest row (up to 8 x 477 on the default rows).

A step = forward + loss + backward + gradient clipping + AdamW step + zero_grad, as `training.loop` runs it, on a
CausalModel with peft LoRA (r=8 on q/k/v/o/gate/up/down) and the value head reading the 32 most recent numbers
(train's recipe). Model: the Qwen2.5-0.5B shape (hidden 896, 14 / 2 heads, intermediate 4864, vocabulary 151,936,
tied), --layers of its 24 decoder layers, random weights, float32 on CPU, sdpa attention. The epoch is timed
--repeats times per mode, round robin, and the fastest is kept. tokens/s = the rows' real tokens / the epoch's
CPU seconds of this process, on one thread by default: on a machine shared with other jobs (this one runs at a
load of 10+ on 2 cores) wall seconds mostly measure the waiting; the wall ratio is printed too. Fewer layers than
24 make the per-token cost that packing does not change (the OvR loss over 151,936 rows at the labelled tokens,
the per-step sweeps of W_cls) a larger share: the ratio is conservative. Run time on the default: ~50 CPU seconds
a round, ~4 minutes on an idle core (12 minutes a round at load 13).

Ends with ONE line ``RESULT key=value ...`` (tokens per CPU second of both, packed_vs_padded their ratio).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from common import build_base

NUM_TOKEN_ID = 151_665  # Qwen2.5's first reserved row


def build_model(layers: int, recent: int, seed: int = 0):
    from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model

    base = build_base(layers, seed, attn_implementation="sdpa")
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM_TOKEN_ID, recent_values=recent,
                                                       lora=LoraSettings(r=8, alpha=16, dropout=0.0)))
    model.action.set_value_units(50.0, 40.0)
    with torch.no_grad():  # a value head that reads its recent numbers (the fits set w_recent in a real run)
        model.action.w_recent.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model.train()


def corpus_rows(name: str, n: int, seed: int):
    """`n` tokenised training rows of the corpus, drawn at random (seed), and a description of the corpus."""
    import datasets

    from causal_adapter.data.corpora import build_corpus
    from causal_adapter.data.pipeline import tokenize_dataset
    from causal_adapter.numbers import NumberTokenizer
    from causal_adapter.saving.assets import load_qwen_tokenizer

    ntok = NumberTokenizer(load_qwen_tokenizer(), NUM_TOKEN_ID)
    if name == "chat":  # multi-turn chats about the bundled series: one to three question/answer turns
        raw = build_corpus("chat")["train"]
        what = "chat (bundled conversations, assistant turns carry the loss)"
    else:  # prompt/completion rows of sunspots histories of 4 to 64 years, mixed
        raw = datasets.concatenate_datasets([build_corpus("sunspots", window=w)["train"] for w in (4, 8, 16, 32, 64)])
        what = "sunspots windows 4/8/16/32/64 (prompt/completion)"
    raw = raw.shuffle(seed=seed).select(range(min(n, len(raw))))
    rows = tokenize_dataset(raw, ntok, add_eos_token=True)
    return rows.select_columns(["input_ids", "numeric_values", "labels", "label_values"]), ntok.pad_token_id, what


def batches_of(rows, collator, batch: int, order):
    """The epoch's batches: rows taken in `order`, `batch` at a time, collated."""
    from causal_adapter.training.data import rows_at

    return [collator(rows_at(rows, order[i:i + batch])) for i in range(0, len(order), batch)]


def epoch_losses(model, batches) -> tuple[float, float, int]:
    """(sum of L_cls x labelled tokens, sum of L_reg x <NUM> labels, labelled tokens) over `batches`, no grad:
    the epoch's total token loss and regression loss, whatever the batching."""
    cls, reg, tokens = 0.0, 0.0, 0
    with torch.no_grad():
        for b in batches:
            out = model(**b)
            n = int((b["labels"][:, 1:] != -100).sum())
            m = int((b["labels"][:, 1:] == NUM_TOKEN_ID).sum())
            cls += float(out.loss_cls) * n
            reg += float(out.loss_reg) * max(1, m)
            tokens += n
    return cls, reg, tokens


def train_epoch(model, batches, optimizer, params) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) for one epoch of optimizer steps (one batch each), as
    `training.loop._optimizer_step`."""
    t, c = time.perf_counter(), time.process_time()
    for b in batches:
        out = model(**b)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t, time.process_time() - c


def main(argv=None) -> int:
    from causal_adapter.data.packing import PackedCollator, pack_dataset
    from causal_adapter.data.pipeline import NumericCollator

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", choices=["chat", "sunspots"], default="chat")
    ap.add_argument("--rows", type=int, default=16, help="training rows drawn from the corpus (one epoch)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen2.5-0.5B has 24)")
    ap.add_argument("--batch", type=int, default=8, help="rows per padded batch")
    ap.add_argument("--max-length", type=int, default=512, help="tokens per packed row")
    ap.add_argument("--packed-batch", type=int, default=4, help="packed rows per packed batch")
    ap.add_argument("--recent-values", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed epochs per mode (the fastest is reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds count work only)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    rows, pad_id, what = corpus_rows(args.corpus, args.rows, args.seed)
    lengths = sorted(len(ids) for ids in rows["input_ids"])
    real_tokens = sum(lengths)
    packed_rows = pack_dataset(rows, args.max_length)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed)).tolist()
    modes = {
        "padded": batches_of(rows, NumericCollator(pad_id), args.batch, order),
        "packed": batches_of(packed_rows, PackedCollator(pad_id), args.packed_batch, list(range(len(packed_rows)))),
    }
    slots = {m: sum(b["input_ids"].numel() for b in bs) for m, bs in modes.items()}
    print(f"corpus: {what}; {len(rows)} rows, tokens per row min {lengths[0]} / median "
          f"{statistics.median(lengths):g} / max {lengths[-1]} (mean {real_tokens / len(rows):.1f}); "
          f"{real_tokens} real tokens")
    for m, bs in modes.items():
        print(f"{m:7s} {len(bs)} steps, {slots[m]} token positions computed ({slots[m] / real_tokens:.2f}x the real "
              f"tokens), up to {max(b['input_ids'].numel() for b in bs)} per step")

    model = build_model(args.layers, args.recent_values, args.seed)
    params = [p for _, p in model.trainable_parameters()]
    # equal loss per token: the same tokens carry the same loss, packed or padded (same weights)
    losses = {m: epoch_losses(model, bs) for m, bs in modes.items()}
    (cls_a, reg_a, n_a), (cls_b, reg_b, n_b) = losses["padded"], losses["packed"]
    cls_rel, reg_rel = abs(cls_a - cls_b) / abs(cls_a), abs(reg_a - reg_b) / max(abs(reg_a), 1e-30)
    print(f"labelled tokens padded {n_a} / packed {n_b}; epoch token loss relative difference {cls_rel:.1e}, "
          f"regression loss {reg_rel:.1e}")
    if n_a != n_b or cls_rel > 1e-4 or reg_rel > 1e-4:
        raise SystemExit("packed and padded epochs do not carry the same loss: the comparison is void")

    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for bs in modes.values():  # warm-up: one step each (allocator, kernels)
        train_epoch(model, bs[:1], optimizer, params)
    times = {m: [] for m in modes}
    for _ in range(args.repeats):  # round robin: a burst of load from other processes hits both modes alike
        for m, bs in modes.items():
            times[m].append(train_epoch(model, bs, optimizer, params))
    # the fastest epoch of each mode, in wall seconds and in this process's CPU seconds (on a machine shared with
    # other jobs the CPU seconds count the work, not the waiting; with --threads 1 they are not inflated by spinning)
    wall = {m: min(w for w, _ in ts) for m, ts in times.items()}
    cpu = {m: min(c for _, c in ts) for m, ts in times.items()}
    for m, ts in times.items():
        print(f"{m:7s} {wall[m]:7.2f} s/epoch  {real_tokens / wall[m]:8.1f} tokens/s  CPU {cpu[m]:7.2f} s/epoch  "
              f"{real_tokens / cpu[m]:8.1f} tokens/CPU-s  (epochs wall/CPU: "
              f"{', '.join(f'{w:.1f}/{c:.1f}' for w, c in ts)})")
    ratio, ratio_wall = cpu["padded"] / cpu["packed"], wall["padded"] / wall["packed"]
    print(f"packed / padded tokens per second: {ratio:.2f}x (CPU seconds), {ratio_wall:.2f}x (wall)")
    assert math.isfinite(ratio)
    print("RESULT " + " ".join([
        f"corpus={args.corpus}", f"rows={len(rows)}", f"layers={args.layers}", f"threads={args.threads}",
        f"len_min={lengths[0]}", f"len_median={statistics.median(lengths):g}", f"len_max={lengths[-1]}",
        f"padded_positions_per_token={slots['padded'] / real_tokens:.3f}",
        f"packed_positions_per_token={slots['packed'] / real_tokens:.3f}",
        f"padded_tok_cpu_s={real_tokens / cpu['padded']:.1f}", f"packed_tok_cpu_s={real_tokens / cpu['packed']:.1f}",
        f"packed_vs_padded={ratio:.3f}", f"packed_vs_padded_wall={ratio_wall:.3f}",
    ]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
