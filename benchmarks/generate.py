"""How many new tokens per second does each decoding mode give against the base's greedy `generate`?

    python benchmarks/generate.py                     # 128 new tokens, batch 1 and 8, best of 2
    python benchmarks/generate.py --new-tokens 32 --repeats 3 --layers 2

The base is a random Qwen2 at the Qwen2.5-0.5B width (hidden 896, vocabulary 151,936) with few layers, float32, on
CPU. Every run generates exactly `--new-tokens` tokens (no eos on either side) from the same left-padded prompts on
the same weights; modes run round robin inside each repeat, the best of `--repeats` counts, and softmax mode must
equal the base token for token (``b<B>_softmax_equals_base``). The per-piece timing of the head (``--unpruned``, the
head breakdown) ran here up to commit 1c2f799 (docs/design-notes/benchmarks.md). Ends with `RESULT key=value ...`.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from causal_adapter import CausalAdapterConfig, get_causal_model
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2, help="transformer layers of the random base (default 2)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs per measurement")
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

    result["new_tokens"] = T
    result["layers"] = args.layers
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
