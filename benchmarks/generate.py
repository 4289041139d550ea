"""Generation speed: new tokens per second of each mode vs the base model's greedy `generate`.

    python benchmarks/generate.py                     # 128 new tokens, batch 1 and 8, best of 2
    python benchmarks/generate.py --new-tokens 32 --repeats 3 --layers 2
    python benchmarks/generate.py --threads 1 --unpruned   # + deterministic without the pruning

The base is a random Qwen2 at the Qwen2.5-0.5B width (hidden 896, 14/2 heads, intermediate
4864, vocabulary 151,936, tied) with few layers, float32, on CPU. Every run generates exactly
`--new-tokens` tokens (no eos on either side), from the same left-padded prompts, on the same
weights. Modes run round-robin inside each repeat (machine noise hits all of them alike); the
best time of `--repeats` counts. A head-only breakdown (one position, `--head-iters` calls)
shows where the time of the deterministic mode goes:

    loc_S            W_cls loc_U + b_cls (the only vocabulary product of softmax/causal mode)
    scale_S naive    |W_cls| scale_U' with |W_cls| formed on every call (a V x H temporary)
    scale_S chunked  the same by chunks of rows (what ovr_pruning=False does)
    scale_S cached   from a |W_cls| copy kept for the call (cache_abs_weight=True: +V*H memory)
    prune bounds     the per-step bound test of ovr_pruning=True (O(V) elementwise) + exact rows
    row norms        ||W_k||_1, ||W_k||_2 for the bounds: one pass over W_cls, cached across calls
    loc_S bf16       W_cls loc_U + b_cls from a bfloat16 product (the deterministic mode, where bf16 is cheap), and
                     the pruned argmax after it (exact rows for the bar and the survivors) against after loc_S
The output ends with one line `RESULT key=value ...`.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from causal_adapter import CausalAdapterConfig, get_causal_model
from causal_adapter.modeling import scoring
from common import build_base

MODES = ("softmax", "deterministic", "causal")


def prompts(batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    lengths = [24 - (3 * i) % 12 for i in range(batch)]  # different lengths -> left padding
    S = max(lengths)
    ids = torch.full((batch, S), 151643, dtype=torch.long)
    mask = torch.zeros(batch, S, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, S - n:] = torch.randint(0, 151_000, (n,), generator=g)
        mask[i, S - n:] = 1
    return ids, mask


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@torch.no_grad()
def head_breakdown(model, batch: int, iters: int) -> dict[str, float]:
    """Milliseconds per call of the pieces of one deterministic step's head, at one position."""
    H = model.W_cls.shape[1]
    g = torch.Generator().manual_seed(0)
    z = torch.randn(batch, H, generator=g) * 3
    loc_U, scale_U = model.abduction(z)
    s = model.action.noisy_scale(scale_U)
    heads = scoring.OvRScorer(model, ovr_pruning=True, cache_abs_weight=True)
    W = model.W_cls
    loc_S = heads.loc_scores(loc_U)
    heads._row_norms()
    heads.abs_scores(s)  # builds the cached |W|
    cached_abs = heads._abs_W
    chunked = scoring.OvRScorer(model, ovr_pruning=False, cache_abs_weight=False)
    counts = []

    def prune():
        idx = heads._candidates(loc_S - heads.thresholds, s)
        counts.append(-1 if idx is None else idx.numel())
        if idx is not None:
            heads.abs_scores(s, idx)

    approx = heads.approx_loc_scores(loc_U)
    pieces = {
        "loc_S": lambda: heads.loc_scores(loc_U),
        "loc_S_bf16": lambda: heads.approx_loc_scores(loc_U),
        "argmax_from_f32": lambda: heads.ovr_argmax(loc_S, s),
        "argmax_from_bf16": lambda: heads.ovr_argmax(approx, s, loc_U),
        "scale_S_naive": lambda: torch.nn.functional.linear(s, W.abs()),
        "scale_S_chunked": lambda: chunked.abs_scores(s),
        "scale_S_cached": lambda: torch.nn.functional.linear(s, cached_abs),
        "prune_bounds": prune,
        "row_norms_once_per_call": lambda: (scoring._NORM_CACHE.clear(),
                                            scoring.OvRScorer(model, ovr_pruning=True,
                                                              cache_abs_weight=False)._row_norms()),
    }
    out = {}
    for name, fn in pieces.items():
        fn()
        out[name] = 1000 * min(timed(fn) for _ in range(iters))
    out["prune_candidates"] = float(max(counts))
    heads._abs_W = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2, help="transformer layers of the random base (default 2)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs per measurement")
    ap.add_argument("--head-iters", type=int, default=5)
    ap.add_argument("--unpruned", action="store_true",
                    help="also time the deterministic mode with ovr_pruning=False (full |W_cls| product per token)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's; on cores shared with other work 1 is steadier)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    T = args.new_tokens

    t0 = time.perf_counter()
    base = build_base(args.layers, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=151_665))
    gc = copy.deepcopy(base.generation_config)
    gc.eos_token_id, gc.do_sample, gc.max_new_tokens, gc.min_new_tokens = None, False, T, None
    print(f"random Qwen2: hidden 896, vocab 151936, {args.layers} layers, float32, "
          f"{torch.get_num_threads()} threads; built in {time.perf_counter() - t0:.1f}s; {T} new tokens, "
          f"best of {args.repeats}")

    result: dict[str, float] = {}
    rows = []
    for B in args.batches:
        ids, mask = prompts(B)
        runs = {
            "base": lambda: base.generate(ids, attention_mask=mask, generation_config=gc),
            **{m: (lambda m=m: model.generate(input_ids=ids, attention_mask=mask, mode=m, max_new_tokens=T,
                                             eos_token_id=[], seed=0)) for m in MODES},
        }
        if args.unpruned:
            runs["deterministic_unpruned"] = lambda: model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=T, eos_token_id=[], ovr_pruning=False)
        best = {k: float("inf") for k in runs}
        outputs = {}
        for _ in range(args.repeats):
            for k, fn in runs.items():
                t = time.perf_counter()
                outputs[k] = fn()
                best[k] = min(best[k], time.perf_counter() - t)
        # sanity: same weights, same greedy tokens in softmax mode
        same = torch.equal(outputs["base"][:, -T:], outputs["softmax"].new_tokens)
        tps = {k: B * T / v for k, v in best.items()}
        for k in runs:
            ratio = tps[k] / tps["base"]
            rows.append((B, k, tps[k], ratio))
            key = k.replace("deterministic", "det")
            result[f"b{B}_{key}_tps"] = round(tps[k], 2)
            if k != "base":
                result[f"b{B}_{key}_ratio"] = round(ratio, 3)
        result[f"b{B}_softmax_equals_base"] = int(same)

    print(f"\n{'batch':>5}  {'mode':<24}{'new tok/s':>10}{'vs base':>9}")
    for B, k, tps, ratio in rows:
        print(f"{B:>5}  {k:<24}{tps:>10.1f}{ratio:>8.2f}x")

    print("\nhead of one deterministic step (ms per call, one position per row):")
    print(f"{'batch':>5}  " + "".join(f"{n:>18}" for n in ("loc_S", "scale_S naive", "scale_S chunked",
                                                            "scale_S cached", "prune bounds", "candidates")))
    for B in args.batches:
        hb = head_breakdown(model, B, args.head_iters)
        print(f"{B:>5}  " + "".join(f"{hb[k]:>18.2f}" for k in ("loc_S", "scale_S_naive", "scale_S_chunked",
                                                                   "scale_S_cached", "prune_bounds"))
              + f"{hb['prune_candidates']:>18.0f}")
        print(f"{'':>5}  bf16 product (scoring.fast_bf16_product here: {scoring.fast_bf16_product(model.W_cls)}): "
              f"loc_S {hb['loc_S_bf16']:.2f} ms; the pruned argmax after it {hb['argmax_from_bf16']:.2f} ms "
              f"(from the float32 loc_S: {hb['argmax_from_f32']:.2f} ms)")
        for k in ("loc_S", "scale_S_naive", "scale_S_chunked", "scale_S_cached", "prune_bounds", "loc_S_bf16",
                  "argmax_from_f32", "argmax_from_bf16"):
            result[f"b{B}_head_{k}_ms"] = round(hb[k], 2)
        result[f"b{B}_prune_candidates"] = int(hb["prune_candidates"])
        if B == args.batches[0]:
            result["row_norms_ms"] = round(hb["row_norms_once_per_call"], 1)
    result["new_tokens"] = T
    result["layers"] = args.layers
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
