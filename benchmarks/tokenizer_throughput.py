"""How fast is number-aware batch encoding against the plain tokenizer on the same text?

    python benchmarks/tokenizer_throughput.py [--mb 5] [--repeats 3]

The text (~5 MB, number-rich) is built offline from the bundled corpora and the seeded arithmetic / unit-conversion
templates, one example per text. Timed, best of ``--repeats``, interleaved: ``plain`` (the transformers tokenizer's
batch call), ``numbers`` (``NumberTokenizer.encode_batch(texts, return_offsets=False)``), ``offsets`` (with per-token
character offsets) and ``padded`` (``NumberTokenizer(texts)``: padded tensors). The last line is ``RESULT key=value
...`` (MB/s, and ratio = numbers MB/s / plain MB/s).
"""
from __future__ import annotations

import argparse
import time


def build_texts(target_mb: float) -> list[str]:
    from causal_adapter.data.corpora import build_corpus

    pool: list[str] = []
    for name, kws in (
        ("sunspots", [dict(window=w) for w in (5, 10, 20, 40)]),
        ("nile", [dict(window=w) for w in (5, 10, 20)]),
        ("co2", [dict(window=w) for w in (6, 12, 24)]),
        ("macro", [dict(window=8, column=c) for c in ("unemp", "infl", "realgdp", "cpi", "tbilrate")]),
        ("diabetes", [dict(seed=0)]),
        ("arithmetic", [dict(n=20000, seed=s) for s in (0, 1)]),
        ("units", [dict(n=20000, seed=s) for s in (0, 1)]),
    ):
        for kw in kws:
            dd = build_corpus(name, **kw)
            for split in dd:
                pool.extend(p + c for p, c in zip(dd[split]["prompt"], dd[split]["completion"]))
    target = int(target_mb * 1e6)
    texts: list[str] = []
    size = 0
    i = 0
    while size < target:
        t = pool[i % len(pool)]
        texts.append(t)
        size += len(t.encode("utf-8"))
        i += 1
    return texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=5.0, help="size of the text in MB (UTF-8)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from causal_adapter.saving.assets import load_qwen_tokenizer
    from causal_adapter.numbers import NumberTokenizer

    tok = load_qwen_tokenizer()
    ntok = NumberTokenizer(tok)
    texts = build_texts(args.mb)
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6

    # sanity: same text, and a number-aware encoding decodes back to it
    sample = ntok.encode_batch(texts[:200])
    assert all(ntok.decode(e) == t for e, t in zip(sample, texts[:200]))
    n_num = sum(sum(1 for x in e.input_ids if x == ntok.num_token_id) for e in sample)
    n_tok_plain = sum(len(x) for x in tok(texts[:200])["input_ids"])
    n_tok_num = sum(len(e.input_ids) for e in sample)

    cases = {
        "plain": lambda: tok(texts),
        "numbers": lambda: ntok.encode_batch(texts, return_offsets=False),
        "offsets": lambda: ntok.encode_batch(texts),
        "padded": lambda: ntok(texts),
    }
    timings: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, fn in cases.items():  # interleaved: a busy neighbour hurts every case alike
            t0 = time.perf_counter()
            fn()
            timings[k].append(time.perf_counter() - t0)
    speed = {k: mb / min(v) for k, v in timings.items()}

    print(f"text: {len(texts)} texts, {mb:.2f} MB; first 200 texts: {n_tok_plain} plain tokens -> "
          f"{n_tok_num} number-aware tokens ({n_num} <NUM>)")
    for k in cases:
        print(f"{k:8s} best {min(timings[k]):7.3f} s   {speed[k]:7.2f} MB/s   ratio {speed[k] / speed['plain']:.2f}")
    print(
        f"RESULT mb={mb:.2f} texts={len(texts)} plain_mb_s={speed['plain']:.3f} numbers_mb_s={speed['numbers']:.3f} "
        f"offsets_mb_s={speed['offsets']:.3f} padded_mb_s={speed['padded']:.3f} "
        f"ratio={speed['numbers'] / speed['plain']:.3f} ratio_offsets={speed['offsets'] / speed['plain']:.3f} "
        f"ratio_padded={speed['padded'] / speed['plain']:.3f} token_ratio={n_tok_num / n_tok_plain:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
