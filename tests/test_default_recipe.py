"""Generation after DEFAULT training (docs/predict.md, "The number layout"), through the CLI a user runs:

    causal-adapter train --train-file train.jsonl --validation-file val.jsonl --max-steps 120

on prompt/completion rows written the way data writes them ("...; food expenditure:" + " 1033.57"), on
the embedded tiny base with the real Qwen tokenizer. Claims, each failing when its mechanism is removed:

* the adapter knows its training data's number layout (the space token before every number) and keeps it
  through saving (`CausalAdapterConfig.number_prefix_id`);
* from a prompt ending ":" or ": ", `generate` writes one number in the training targets' range, its
  error within 1.2x of `predict`'s on the same rows, then ends the answer (EOS, a default of `train` now);
  without the layout rule the number comes at the ":" position, where the value head never fitted;
* `generate` and `predict` report the same value and the same calibrated intervals for the same row.
"""
import json
import math
import random

import pytest
import torch

from causal_adapter.commands.main import main

TINY32 = ["--tiny-hidden-size", "32", "--tiny-layers", "1"]


def engel_rows(n, seed):
    """Income -> food spending rows (a linear law with noise), as the data would write them."""
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        x = round(r.uniform(500, 5000), 2)
        y = round(0.2 * x + 300 + r.gauss(0, 40), 2)
        rows.append({"prompt": f"Household income {x}; food expenditure:", "completion": f" {y}"})
    return rows


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, qwen_tokenizer):
    """(the reloaded adapter, training targets, test rows) after `causal-adapter train` with its defaults."""
    from causal_adapter.saving.assets import load_base
    from causal_adapter.model import CausalModel

    tmp = tmp_path_factory.mktemp("default_recipe")
    train_rows = engel_rows(160, 0)
    args = ["train", "--train-file", _jsonl(tmp / "train.jsonl", train_rows),
            "--validation-file", _jsonl(tmp / "val.jsonl", engel_rows(40, 1)), "--max-steps", "120",
            "--output-dir", str(tmp / "run"), "--no-plot", "--no-progress", *TINY32]
    assert main(args) == 0
    base, _ = load_base(None, "qwen2", "float32", 32, 1)
    model = CausalModel.from_pretrained(base, tmp / "run" / "adapter", tokenizer=qwen_tokenizer)
    targets = [float(r["completion"]) for r in train_rows]
    return model, targets, engel_rows(10, 2)


def test_the_adapter_keeps_the_number_layout_of_its_training_data(trained, qwen_tokenizer):
    model, _, _ = trained
    space = qwen_tokenizer.encode(" ")
    assert len(space) == 1
    assert model.causal_config.number_prefix_id == space[0]  # ':' ' ' <NUM>: the value is fitted at the space
    assert model.causal_config.number_contexts == space


@pytest.mark.parametrize("ending", [":", ": "])
def test_default_training_generates_one_plausible_number_then_ends(trained, qwen_tokenizer, ending):
    model, targets, rows = trained
    prompts = [r["prompt"][:-1] + ending for r in rows]
    truth = [float(r["completion"]) for r in rows]
    gen = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=6)
    pred = model.predict_values(prompts, tokenizer=qwen_tokenizer)
    first = [nums[0]["value"] if nums else None for nums in gen.numbers]
    plausible = sum(v is not None and min(targets) <= v <= max(targets) for v in first)
    assert plausible >= 9, (first, gen.texts)
    # one number, then EOS: the answer ends (without EOS in training it runs on into more numbers)
    ended = sum(bool(gen.finished[i]) and len(gen.numbers[i]) == 1 for i in range(len(rows)))
    assert ended >= 9, gen.texts
    gen_mae = sum(abs((v if v is not None else float("inf")) - y) for v, y in zip(first, truth)) / len(rows)
    pred_mae = sum(abs(p["value"] - y) for p, y in zip(pred, truth)) / len(rows)
    assert gen_mae <= 1.2 * pred_mae, (gen_mae, pred_mae)
    if ending == ":":  # written as the data writes it: the space, then the number
        assert all(t.startswith(" ") and not t.startswith("  ") for t in gen.texts), gen.texts


@pytest.mark.parametrize("ending", [":", ": "])
def test_generate_and_predict_report_the_same_interval(trained, qwen_tokenizer, ending):
    model, _, rows = trained
    assert model.causal_config.value_calibration is not None
    prompts = [r["prompt"][:-1] + ending for r in rows[:4]]
    gen = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=3)
    pred = model.predict_values(prompts, tokenizer=qwen_tokenizer)
    for nums, p in zip(gen.numbers, pred):
        n = nums[0]
        # the same position and heads; the KV-cached steps and predict's one forward differ by float32 noise,
        # which a least-squares head on near-collinear random features amplifies (ridge lambda 1e-10 here,
        # predict alone moves a row by ~2% of its 90% width between batch sizes 1 and 4):
        # 10% of the width. Read at the ":" instead, the value is off by ~1e7.
        tol = 0.1 * (p["upper_90"] - p["lower_90"])
        assert n["exact"] == pytest.approx(p["value"], abs=tol)
        for level in ("50", "90"):
            assert n[f"interval_{level}"] == pytest.approx((p[f"lower_{level}"], p[f"upper_{level}"]), abs=tol)
    # ":" and ": " give the same row: both read the value at the space, where training fitted it
    other = model.predict_values([r["prompt"][:-1] + (": " if ending == ":" else ":") for r in rows[:4]],
                                 tokenizer=qwen_tokenizer)
    for a, b in zip(pred, other):
        assert a["value"] == pytest.approx(b["value"], rel=1e-4)
        assert a["upper_90"] - a["lower_90"] == pytest.approx(b["upper_90"] - b["lower_90"], rel=1e-4)


def test_a_number_chosen_where_training_never_fitted_is_written_after_the_space(trained, qwen_tokenizer):
    """The token side of a short run may put `<NUM>` straight after ":" (the seeds' recipe does, at every
    position): generation then writes the space first and reads the value there, as training fitted it."""
    import copy

    model, targets, rows = trained
    eager = copy.deepcopy(model)
    with torch.no_grad():
        eager.action.b_cls[eager.num_token_id] += 1e4  # <NUM> is the argmax everywhere
    prompts = [r["prompt"] for r in rows]  # ending ":"
    gen = eager.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=2)
    pred = model.predict_values(prompts, tokenizer=qwen_tokenizer)
    space = model.causal_config.number_prefix_id
    assert gen.new_tokens[:, 0].tolist() == [space] * len(rows)
    assert gen.new_tokens[:, 1].tolist() == [model.num_token_id] * len(rows)
    for nums, p, text in zip(gen.numbers, pred, gen.texts):
        assert text.startswith(" ") and min(targets) <= nums[0]["value"] <= max(targets), text
        assert nums[0]["exact"] == pytest.approx(p["value"], abs=0.1 * (p["upper_90"] - p["lower_90"]))  # as above


def test_causal_values_over_a_thousand_individuals_spread_as_the_heads_interval(trained, qwen_tokenizer):
    """SPEC 4 (causal, amended): the value causal sampling writes is the head's own Cauchy at the quantile the sampled
    u gives it, so 1,000 individuals on one row (4 seeds x 250 rows, each row its own draws) spread as the head's raw
    interval: the share below / above its 50% bounds is 1/4 each and below / above its 90% bounds 1/20 each, within
    4 standard errors of a binomial share. The value at u itself (loc_Y with u for loc_U) is 1e4x wider or, with
    w_reg = 0, the deterministic value every time; a value in other units misses the bounds. <NUM> is made the argmax
    (a bias of 1e4, as above): the layout writes the space, then the number at the fitted position."""
    import copy

    model, _, rows = trained
    eager = copy.deepcopy(model)
    with torch.no_grad():
        eager.action.b_cls[eager.num_token_id] += 1e4
    prompt = rows[0]["prompt"]
    values, bounds = [], set()
    for seed in range(4):
        gen = eager.generate([prompt] * 250, tokenizer=qwen_tokenizer, max_new_tokens=2, mode="causal", seed=seed)
        for nums in gen.numbers:
            n = nums[0]
            values.append(n["exact"])
            bounds.add((round(n["raw_interval_50"][0], 3), round(n["raw_interval_50"][1], 3),
                        round(n["raw_interval_90"][0], 3), round(n["raw_interval_90"][1], 3)))
    assert len(values) == 1000 and len(bounds) == 1  # one row: one head, one interval
    lo50, hi50, lo90, hi90 = bounds.pop()
    v = torch.tensor(values, dtype=torch.float64)
    for share, p in (((v < lo50).double().mean(), 0.25), ((v > hi50).double().mean(), 0.25),
                     ((v < lo90).double().mean(), 0.05), ((v > hi90).double().mean(), 0.05)):
        assert abs(float(share) - p) <= 4 * math.sqrt(p * (1 - p) / len(v)), (float(share), p, lo50, hi50, lo90, hi90)
    # the token's own draw: the deterministic mode's value is the interval's centre, unchanged
    det = eager.generate([prompt], tokenizer=qwen_tokenizer, max_new_tokens=2)
    assert det.numbers[0][0]["exact"] == pytest.approx(float(v.median()), rel=0.05)
