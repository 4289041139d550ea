"""A completion's values and the labels between them (`causal_adapter.records`), on the real tokenizer: the value
head's fit, its metrics and its calibration read the values only."""
from __future__ import annotations

import torch

from causal_adapter.numbers import NumberTokenizer
from causal_adapter.records import value_label_mask, value_targets
from causal_adapter.saving.assets import load_qwen_tokenizer

TOKENIZER = load_qwen_tokenizer()
NUM = len(TOKENIZER)
NT = NumberTokenizer(TOKENIZER, NUM)


def row(prompt: str, completion: str) -> tuple[list[int], list[int], list[float]]:
    a, b = NT.encode(prompt), NT.encode(completion)
    return (a.input_ids + b.input_ids, [-100] * len(a.input_ids) + b.input_ids, a.numeric_values + b.numeric_values)


def values_kept(prompt: str, completion: str) -> list[float]:
    ids, labels, vals = row(prompt, completion)
    return [v for i, (v, k) in enumerate(zip(vals, value_label_mask(ids, labels, NUM))) if k]


def test_a_forecasting_completions_labels_are_not_values():
    assert values_kept("Monthly CO2. 2016-06: 31.7; 2016-07:",
                       " 33.2; 2016-08: 32.9; 2016-09: 30.4; 2016-10: 29.8") == [33.2, 32.9, 30.4, 29.8]
    assert values_kept("Yearly. 1999: 3.1; 2000:", " 3.2; 2001: 3.3; 2002: 3.0") == [3.2, 3.3, 3.0]


def test_other_completions_keep_every_number():
    assert values_kept("Q: how many?", " 12") == [12.0]
    assert values_kept("The point:", " x=3, y=5") == [3.0, 5.0]
    assert values_kept("Next three:", " 4, 5, 6") == [4.0, 5.0, 6.0]
    assert values_kept("2016-07:", " 33.2") == [33.2]  # one value: its prompt's numbers are not labels


def test_a_packed_row_reads_each_completion_alone_and_the_batch_form_agrees():
    a = row("Sales. 2016-06: 31.7; 2016-07:", " 33.2; 2016-08: 32.9")
    b = row("Q: how many?", " 12")
    ids, labels = a[0] + b[0], a[1] + b[1]
    mask = value_label_mask(ids, labels, NUM)
    assert [v for v, k in zip(a[2] + b[2], mask) if k] == [33.2, 32.9, 12.0]
    batch_ids = torch.tensor([ids, b[0] + [0] * (len(ids) - len(b[0]))])
    batch_labels = torch.tensor([labels, b[1] + [-100] * (len(ids) - len(b[1]))])
    got = value_targets(batch_ids, batch_labels, NUM)
    assert got[0].tolist() == mask
    assert got[1].tolist() == [lab == NUM for lab in batch_labels[1].tolist()]


def test_the_heads_fit_reads_rows_spread_over_the_file_about_max_targets_values():
    """A file ordered by series: the fit's rows come from all of it, not its first rows (`spread_rows`)."""
    from datasets import Dataset

    from causal_adapter.training.value_head.lifecycle import spread_rows

    rows = [row(f"Series {k}. 2016-06: 31.7; 2016-07:", f" {k}.5; 2016-08: 32.9; 2016-09: 30.4; 2016-10: 29.8")
            for k in range(100)]
    ds = Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows],
                            "numeric_values": [r[2] for r in rows]})
    picked, _ = spread_rows(ds, NUM, 40)
    firsts = [vals[ids.index(NUM, len(ids) - 26)] for ids, vals in zip(picked["input_ids"], picked["numeric_values"])]
    assert len(firsts) == 10 and firsts[0] == 0.5 and firsts[-1] == 99.5  # 4 values a row: 10 rows, first to last
    assert spread_rows(ds, NUM, 10_000)[0]["input_ids"] == ds["input_ids"]
