"""A head on log y writes only what it can (issue: "a log head crashes `generate`"; docs/values.md "What a log head
writes"), through every reader: `generate`, `predict`, the server and the horizon, in float32 and under a bf16 CPU
autocast.

The case, as a user meets it: `causal-adapter train --value-transform log` on the Engel rows of
tests/test_default_recipe.py, then `generate(max_new_tokens=6)`. After the answer some rows choose a second <NUM> at a
position the head was never fitted at; its location there is ~1,250 on log y. Before the fix, exp overflowed float32
to inf, the inf was fed back, the hidden state went NaN and the next step raised an IndexError from the OvR pruning.

Claims, each failing when its mechanism is removed:
* the adapter records its training values' range, and its bounds on log y are that range widened by its width;
* no generated number's location lies outside the bounds (`ValueMap.writable`): such a row ends before the number with
  a `stop_reason` naming the bounds, the others write what they write anyway (a row alone gives the same);
* a row whose hidden state is NaN ends with its reason, and the rows beside it are untouched;
* `predict` at a position the head was not fitted at clamps to the bounds; an adapter without a range (saved before
  the field) still writes no infinite value (the exp's clamp is float32's own);
* the server answers the same rows with the same texts, values and `stop_reason`s; a horizon writes finite values.
"""
import copy
import math

import pytest
import torch

from causal_adapter.commands.main import main
from causal_adapter.modeling.value_transform import ValueMap, log_bounds, value_map_of
from test_default_recipe import TINY32, _jsonl, engel_rows


@pytest.fixture(scope="module")
def log_adapter(tmp_path_factory, qwen_tokenizer):
    """(the reloaded log-head adapter, its directory, 10 test prompts) after `train --value-transform log`."""
    from causal_adapter.model import CausalModel
    from causal_adapter.saving.assets import load_base

    tmp = tmp_path_factory.mktemp("log_head")
    args = ["train", "--train-file", _jsonl(tmp / "train.jsonl", engel_rows(160, 0)),
            "--validation-file", _jsonl(tmp / "val.jsonl", engel_rows(40, 1)), "--max-steps", "120",
            "--value-transform", "log", "--output-dir", str(tmp / "run"), "--no-plot", "--no-progress", *TINY32]
    assert main(args) == 0
    base, _ = load_base(None, "qwen2", "float32", 32, 1)
    model = CausalModel.from_pretrained(base, tmp / "run" / "adapter", tokenizer=qwen_tokenizer)
    return model, tmp / "run" / "adapter", [r["prompt"] for r in engel_rows(10, 2)]


def _bounds(model):
    lo, hi = model.value_map.bounds
    return math.exp(lo), math.exp(hi)


def test_the_adapter_records_its_range_and_bounds(log_adapter):
    model, _, _ = log_adapter
    cfg = model.causal_config
    assert cfg.value_transform == "log" and cfg.value_positive
    train = [float(r["completion"]) for r in engel_rows(160, 0)]
    assert cfg.value_range == pytest.approx([min(train), max(train)], rel=1e-6)
    width = max(math.log(max(train)) - math.log(min(train)), math.log(10.0))  # at least a factor of 10
    assert model.value_map.bounds == pytest.approx((math.log(min(train)) - width, math.log(max(train)) + width))
    # a single value: widened by a factor of 10 on each side
    assert log_bounds([5.0, 5.0]) == pytest.approx((math.log(0.5), math.log(50.0)))


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_generate_never_writes_a_number_the_head_cannot(log_adapter, qwen_tokenizer, autocast):
    """The issue's case (float32: 2 of the 10 rows choose a second number), and the same made certain: <NUM> the
    argmax everywhere (a bias of 1e4), so every row writes its answer, then a second number after it."""
    model, _, prompts = log_adapter
    eager = copy.deepcopy(model)
    with torch.no_grad():
        eager.action.b_cls[eager.num_token_id] += 1e4
    lo, hi = model.value_map.bounds
    for m in (model, eager):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            gen = m.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=6)
        ended = [i for i, reason in enumerate(gen.stop_reasons) if reason is not None]
        if m is eager or not autocast:
            assert ended, "the case is not met: no row chose a number where the head cannot write one"
        for i, nums in enumerate(gen.numbers):
            # the answer's number is written in float32; under bf16 this head (bf16_shift 0.8 of its units: it warns)
            # may be off by more than its bounds even there, and the row then ends before it
            assert nums or autocast, gen.texts[i]
            for n in nums:
                assert lo <= n["loc"] <= hi, (i, n)
                assert math.isfinite(n["value"]) and n["value"] > 0
                assert all(math.isfinite(b) and b > 0 for b in (*n["interval_50"], *n["interval_90"]))
        for i in ended:
            reason = gen.stop_reasons[i]
            assert "cannot write" in reason and "outside the values it writes" in reason, reason
            assert f"{_bounds(model)[1]:.4g}" in reason, reason
            assert not gen.finished[i] and int(gen.lengths[i]) < 6
        # the rows beside an ended one go on: each writes the tokens it writes alone, and ends as it ends alone
        for i in range(0, len(prompts), 3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                alone = m.generate([prompts[i]], tokenizer=qwen_tokenizer, max_new_tokens=6)
            n = int(gen.lengths[i])
            assert alone.new_tokens[0].tolist() == gen.new_tokens[i, :n].tolist()
            assert (alone.stop_reasons[0] is None) == (gen.stop_reasons[i] is None)


def test_a_row_whose_hidden_state_is_not_finite_ends_and_the_others_go_on(log_adapter, qwen_tokenizer):
    model, _, prompts = log_adapter
    prompts = prompts[:3]
    clean = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=4)

    def poison(module, args, output):  # the second decoding step of row 1: its last hidden state NaN
        h = output.last_hidden_state
        if h.shape[1] == 1:
            calls.append(1)
            if len(calls) == 2:
                h[1, -1] = math.nan
        return output

    calls = []
    handle = model.decoder.register_forward_hook(poison)
    try:
        gen = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=4)
    finally:
        handle.remove()
    assert "hidden state is not finite" in gen.stop_reasons[1]
    assert int(gen.lengths[1]) == 2  # it wrote steps 1 and 2, then ended before step 3
    assert gen.texts[1] == clean.texts[1][:len(gen.texts[1])]
    for i in (0, 2):
        assert gen.texts[i] == clean.texts[i] and gen.stop_reasons[i] == clean.stop_reasons[i]
        assert torch.equal(gen.new_tokens[i, :int(gen.lengths[i])], clean.new_tokens[i, :int(clean.lengths[i])])


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_predict_where_the_head_was_not_fitted_stays_within_the_bounds(log_adapter, qwen_tokenizer, autocast):
    model, _, prompts = log_adapter
    gen = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=6)
    at = [i for i, reason in enumerate(gen.stop_reasons) if reason is not None]
    rows = [prompts[i] + gen.texts[i] for i in at]  # the text up to the number the head cannot write
    lo, hi = _bounds(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        pred = model.predict_values(rows, tokenizer=qwen_tokenizer)
    for p in pred:
        assert p["value"] == pytest.approx(hi, rel=1e-6)  # far above: the nearest bound
        for level in ("50", "90"):
            assert lo <= p[f"lower_{level}"] <= p["value"] <= p[f"upper_{level}"] <= hi * (1 + 1e-9)


def test_an_adapter_without_a_range_writes_no_infinite_value(log_adapter, qwen_tokenizer):
    model, _, prompts = log_adapter
    old = copy.deepcopy(model)
    old.causal_config.value_range = None  # as an adapter saved before the field
    old.action.set_value_map(value_map_of(old.causal_config))
    assert old.value_map.bounds is None
    h = torch.tensor([1251.0, -1251.0], dtype=torch.float32)
    v = ValueMap("log").to_value(h)
    assert bool(torch.isfinite(v).all()) and bool((v > 0).all())  # clamped in float32, where the exp runs
    gen = old.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=6)
    assert any(r is not None and "not finite" in r for r in gen.stop_reasons), gen.stop_reasons
    for nums in gen.numbers:
        assert all(math.isfinite(n["value"]) for n in nums)


def test_the_horizon_of_a_log_head_writes_finite_values(log_adapter, qwen_tokenizer):
    """With continuations every step's values and bounds are finite and within the bounds; in free text the
    deterministic path chooses the number the head cannot write: a clear error, not an exception from a later step."""
    model, _, prompts = log_adapter
    forced = model.predict_horizon(prompts[:2], tokenizer=qwen_tokenizer, horizon=3, paths=20, seed=0,
                                   continuations=[["; food expenditure:"] * 2] * 2)
    lo, hi = _bounds(model)
    for row in forced:
        assert len(row["horizon"]) == 3
        for step in row["horizon"]:
            for key, v in step.items():
                if key != "step":
                    assert lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9), (key, v, row["horizon"])
    eager = copy.deepcopy(model)
    with torch.no_grad():
        eager.action.b_cls[eager.num_token_id] += 1e4  # a number right after the answer
    with pytest.raises(ValueError, match="cannot write"):
        eager.predict_horizon(prompts[:1], tokenizer=qwen_tokenizer, horizon=3, paths=20, seed=0)


def test_the_server_answers_as_generate_does(log_adapter, qwen_tokenizer, tmp_path):
    """A live `causal-adapter serve` on the same adapter, through the openai client: the same texts, values and
    stop reasons as in-process `generate`."""
    from openai import OpenAI
    from serve_fixtures import Server

    model, adapter, prompts = log_adapter
    gen = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=6)
    server = Server(["--adapter", f"log={adapter}", *TINY32], tmp_path / "serve.log").wait_ready()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        got = client.completions.create(model="log", prompt=prompts, max_tokens=6, temperature=0)
    finally:
        server.stop()
    choices = sorted(got.choices, key=lambda c: c.index)
    for i, c in enumerate(choices):
        assert c.text == gen.texts[i]
        extra = c.model_extra
        assert extra["stop_reason"] == gen.stop_reasons[i]
        assert c.finish_reason == ("stop" if gen.stop_reasons[i] is not None or gen.finished[i] else "length")
        assert [v["value"] for v in extra["values"]] == pytest.approx([n["value"] for n in gen.numbers[i]])
        for v, n in zip(extra["values"], gen.numbers[i]):
            assert (v["lower_90"], v["upper_90"]) == pytest.approx(n["interval_90"], rel=1e-6)
