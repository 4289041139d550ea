"""The rows every offline corpus is made of (`corpora`): a number in canonical format (`canonical_value`), a series
cut into windows as prompt / completion rows (`series_rows`), distinct templated rows (`_unique_rows`), and the
split of rows into a train / validation / test ``datasets.DatasetDict`` (`DEFAULT_SPLIT`, `SPLITS`), with the
columns the baselines read (target, previous, time, t_index, series)."""
from __future__ import annotations

import random
from typing import Callable

from ..numbers import format_number

DEFAULT_SPLIT = (0.8, 0.1, 0.1)
SPLITS = ("train", "validation", "test")


def _split_sizes(n: int, split_fractions, name: str) -> tuple[int, int, int]:
    fr = tuple(float(x) for x in split_fractions)
    if len(fr) != 3 or any(not (x > 0) for x in fr) or abs(sum(fr) - 1.0) > 1e-6:
        raise ValueError(f"split_fractions must be 3 positive fractions summing to 1, got {split_fractions!r}")
    n_val = max(1, int(round(n * fr[1])))
    n_test = max(1, int(round(n * fr[2])))
    n_train = n - n_val - n_test
    if n_train < 1:
        raise ValueError(f"{name}: only {n} examples, too few for a train/validation/test split {fr}")
    return n_train, n_val, n_test


def _baseline_features() -> dict:
    """The columns every corpus row carries beside its text: the target and what the baselines read."""
    import datasets

    return {"target": datasets.Value("float64"), "previous": datasets.Value("float64"),
            "time": datasets.Value("string"), "t_index": datasets.Value("int64"), "series": datasets.Value("string")}


def _to_dataset_dict(rows: list[dict], split_fractions, name: str):
    import datasets

    n_train, n_val, _ = _split_sizes(len(rows), split_fractions, name)
    parts = {"train": rows[:n_train], "validation": rows[n_train:n_train + n_val], "test": rows[n_train + n_val:]}
    features = datasets.Features({"prompt": datasets.Value("string"), "completion": datasets.Value("string"),
                                  **_baseline_features()})
    return datasets.DatasetDict({
        k: datasets.Dataset.from_list(v, features=features) for k, v in parts.items()
    })


def canonical_value(v: float) -> tuple[str, float]:
    s = format_number(v)
    return s, float(s)


def series_rows(series: str, title: str, times: list[str], values: list[float], window: int) -> list[dict]:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    if window >= len(values) - 2:
        raise ValueError(f"window={window} too large for the {series!r} series of {len(values)} points")
    texts = [canonical_value(v) for v in values]
    rows = []
    for i in range(window, len(values)):
        hist = "; ".join(f"{times[j]}: {texts[j][0]}" for j in range(i - window, i))
        rows.append({
            "prompt": f"{title} {hist}; {times[i]}:",
            "completion": " " + texts[i][0],
            "target": texts[i][1],
            "previous": texts[i - 1][1],
            "time": times[i],
            "t_index": i,
            "series": series,
        })
    return rows


def _unique_rows(n: int, seed: int, make: Callable[[random.Random], tuple[str, float, float] | None], series: str):
    if isinstance(n, bool) or not isinstance(n, int) or n < 3:
        raise ValueError(f"n must be an int >= 3, got {n!r}")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise ValueError(f"{series}: could not generate {n} distinct examples")
        made = make(rng)
        if made is None:
            continue
        prompt, value, previous = made
        if prompt in seen:
            continue
        seen.add(prompt)
        s, v = canonical_value(value)
        rows.append({"prompt": prompt, "completion": " " + s, "target": v, "previous": previous,
                     "time": "", "t_index": len(rows), "series": series})
    return rows
