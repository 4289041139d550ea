"""docs/reliability.md: bad input, faults and numerics give a clear error or an exact recovery, never silent damage.

Each test is one row (or a few rows) of the README table "What happens when ...". Cases already covered
elsewhere are cited there and not repeated here.
"""
import json
import math
import multiprocessing as mp
import os
import random
import signal
import time

import datasets
import pytest
import torch
from safetensors.torch import load_file, save_file

from causal_adapter import CausalAdapterConfig, CausalModel, LoraSettings, get_causal_model
from causal_adapter.saving.artifacts import CONFIG_NAME, WEIGHTS_NAME, read_adapter_files
from causal_adapter.saving.assets import build_tiny_qwen
from causal_adapter.modeling.cauchy import cauchy_nll, ovr_probability
from causal_adapter.modeling.numeric_embedding import symlog
from causal_adapter.modeling.loss import fused_ovr_loss, gated_regression_loss, reference_ovr_loss
from causal_adapter.numbers import FLOAT32_MAX, NumberTokenizer, find_numbers
from conftest import small_vocab_qwen

datasets.disable_progress_bars()
NUM = 300  # <NUM> row of the small-vocabulary models (vocab 320)


def wrap(base=None, **cfg):
    cfg.setdefault("num_token_id", NUM)
    return get_causal_model(base if base is not None else small_vocab_qwen(), CausalAdapterConfig(**cfg))


def ids_with_num(shape=(2, 6), seed=0, num_at=((0, 3),)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 290, shape, generator=g)
    for i, j in num_at:
        ids[i, j] = NUM
    return ids


def all_grads_finite(model):
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for _, p in model.trainable_parameters())


@pytest.fixture(scope="module")
def ntok(qwen_tokenizer):
    return NumberTokenizer(qwen_tokenizer)


@pytest.fixture(scope="module")
def real_model(qwen_tokenizer):
    """A one-layer Qwen2 with the real 151,936-row vocabulary (for texts through the real tokenizer)."""
    return get_causal_model(build_tiny_qwen("qwen2", hidden_size=32, num_layers=1), tokenizer=qwen_tokenizer)


# =========================================================================== text
TEXT_CASES = [
    # text, expected [(source, value)] of the <NUM> tokens
    ("", []),
    ("   \n\t ", []),
    ("42", [("42", 42.0)]),
    ("1 2.5 -3", [("1", 1.0), ("2.5", 2.5), ("-3", -3.0)]),
    ("nan inf NaN -inf Infinity", []),
    ("1e400 and -1e400", []),
    ("7" * 500, []),
    ("3.4028234663852886e38 1e39", [("3.4028234663852886e38", FLOAT32_MAX)]),
    ("-0", [("-0", -0.0)]),
    ("\u22125 K", [("\u22125", -5.0)]),
    ("<NUM>", []),
    ("<NUM>5", [("5", 5.0)]),
    ("5<NUM>", [("5", 5.0)]),
    ("<NUM>-5<NUM>", [("-5", -5.0)]),
    ("<NUM> 12 <NUM>", [("12", 12.0)]),
]


@pytest.mark.parametrize("text,expected", TEXT_CASES, ids=[repr(t)[:30] for t, _ in TEXT_CASES])
def test_text_edge_cases_encode_and_round_trip(ntok, qwen_tokenizer, text, expected):
    enc = ntok.encode(text)
    got = [(s, v) for t, s, v in zip(enc.input_ids, enc.number_texts, enc.numeric_values) if t == ntok.num_token_id]
    assert got == expected
    for (_, v), (_, e) in zip(got, expected):  # the sign of -0 survives
        assert math.copysign(1.0, v) == math.copysign(1.0, e)
    assert ntok.decode(enc) == text  # nothing is lost: non-numbers stay text, whole
    if not expected:  # no number: exactly the tokenizer's ids (the literal "<NUM>" is ordinary text)
        assert enc.input_ids == qwen_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert all(v == 0.0 for t, v in zip(enc.input_ids, enc.numeric_values) if t != ntok.num_token_id)


def test_overflowing_number_stays_text_whole_never_split(ntok):
    text = "x " + "9" * 500 + " y"
    assert find_numbers(text) == []
    enc = ntok.encode(text)
    assert ntok.num_token_id not in enc.input_ids and ntok.decode(enc) == text


def test_empty_text_alone_is_refused_and_padded_with_others(real_model, ntok):
    batch = ntok([""])
    assert batch["input_ids"].shape == (1, 0)
    with pytest.raises(ValueError, match=r"input_ids has no positions \(shape \(1, 0\)\)"):
        real_model(**batch)
    # next to a real text, the empty text is a row of padding (mask 0): the real row is unchanged
    batch = ntok(["", "a 1 b"])
    assert batch["attention_mask"][0].sum() == 0
    with torch.no_grad():
        both = real_model(**batch)
        alone = real_model(**ntok(["a 1 b"]))
    assert torch.isfinite(both.loc_U).all() and torch.isfinite(both.loc_Y).all()
    torch.testing.assert_close(both.loc_Y[1], alone.loc_Y[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("text", ["   \n\t ", "42", "1 2.5 -3 4e-3", "<NUM> 12 <NUM>"])
def test_whitespace_and_number_only_texts_train(real_model, ntok, text):
    batch = ntok([text])
    real_model.zero_grad(set_to_none=True)
    out = real_model(**batch, labels=batch["input_ids"])
    assert torch.isfinite(out.loss)
    n = batch["input_ids"].shape[1]
    if n == 1:  # one position predicts nothing: loss exactly 0
        assert out.loss.item() == 0.0
    out.loss.backward()
    assert all_grads_finite(real_model)


# =========================================================================== tensors
def test_shape_mismatches_are_refused():
    model = wrap()
    ids = ids_with_num((1, 5), num_at=())
    with pytest.raises(ValueError, match=r"labels has shape \(1, 4\) but input_ids has \(1, 5\)"):
        model(ids, labels=ids[:, :4])
    with pytest.raises(ValueError, match=r"label_values has shape \(1, 3\) but input_ids has \(1, 5\)"):
        model(ids, labels=ids, label_values=torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 4\) but input_ids has \(1, 5\)"):
        model(ids, attention_mask=torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\], got shape \(5,\)"):
        model(ids[0])


def test_label_values_must_align_with_labels():
    model = wrap()
    ids = ids_with_num((1, 6), num_at=((0, 3),))
    good = torch.zeros(1, 6)
    good[0, 3] = 7.5
    out = model(ids, good, labels=ids, label_values=good)
    assert torch.isfinite(out.loss) and out.loss_reg.item() != 0.0
    shifted = torch.roll(good, -1, dims=1)  # a pre-shifted copy: the value sits under a text label
    with pytest.raises(ValueError, match=r"label_values is non-zero \(7.5\) at index \(0, 2\) whose label \d+ is not <NUM>"):
        model(ids, good, labels=ids, label_values=shifted)
    # values under an ignored label are allowed (they never enter the loss)
    labels = ids.clone()
    labels[0, 2] = -100
    model(ids, good, labels=labels, label_values=good + shifted)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_label_values_are_refused(bad):
    model = wrap()
    ids = ids_with_num((1, 6))
    lv = torch.zeros(1, 6)
    lv[0, 3] = bad
    with pytest.raises(ValueError, match=r"label_values contains NaN or inf \(first at index \(0, 3\)\)"):
        model(ids, labels=ids, label_values=lv)


@pytest.mark.parametrize("label,shown", [(-5, "-5"), (320, "320"), (-101, "-101")])
def test_labels_outside_vocabulary_are_refused(label, shown):
    model = wrap()
    ids = ids_with_num((1, 5), num_at=())
    labels = ids.clone()
    labels[0, 2] = label
    with pytest.raises(ValueError, match=rf"labels must be -100 or in \[0, 320\); got {shown} at index \(0, 2\)"):
        model(ids, labels=labels)


@pytest.mark.parametrize("value,shown", [(320, "320"), (-1, "-1"), (10**6, "1000000")])
def test_input_ids_outside_vocabulary_are_refused(value, shown):
    model = wrap()
    ids = ids_with_num((2, 5), num_at=())
    ids[1, 4] = value
    with pytest.raises(ValueError, match=rf"input_ids must be in \[0, 320\); got {shown} at index \(1, 4\)"):
        model(ids)


def test_input_ids_must_be_integers():
    model = wrap()
    with pytest.raises(ValueError, match="input_ids must be an integer tensor, got dtype torch.float32"):
        model(torch.ones(1, 3))


def test_batch_size_one_equals_its_row_in_a_padded_batch():
    model = wrap()
    a = ids_with_num((1, 6), seed=1)
    b = ids_with_num((1, 4), seed=2, num_at=((0, 1),))
    va, vb = torch.zeros(1, 6), torch.zeros(1, 4)
    va[0, 3], vb[0, 1] = 12.5, -3.0
    ids = torch.full((2, 6), 0)
    ids[0], ids[1, :4] = a[0], b[0]
    vals = torch.zeros(2, 6)
    vals[0], vals[1, :4] = va[0], vb[0]
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    labels = ids.clone()
    labels[1, 4:] = -100
    with torch.no_grad():
        batch = model(ids, vals, attention_mask=mask, labels=labels)
        one_a = model(a, va, labels=a)
        one_b = model(b, vb, labels=b)
    torch.testing.assert_close(batch.loc_U[0], one_a.loc_U[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch.loc_Y[1, :4], one_b.loc_Y[0], rtol=1e-5, atol=1e-5)
    # the batch loss is the mean over the 5 + 3 labelled positions of both rows
    expected_cls = (5 * one_a.loss_cls + 3 * one_b.loss_cls) / 8
    torch.testing.assert_close(batch.loss_cls, expected_cls, rtol=1e-5, atol=1e-5)


def test_attention_mask_all_zero_row_is_finite_and_labels_there_are_refused():
    model = wrap()
    ids = ids_with_num((2, 5), num_at=())
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask, return_scores=True)
    for t in (out.loc_U, out.scale_U, out.loc_Y, out.scale_Y, out.loc_S, out.scale_S):
        assert torch.isfinite(t).all()
    # labels on the fully masked row would train on padding: refused
    with pytest.raises(ValueError, match=r"labels has a target \(\d+\) at index \(1, 0\) where attention_mask is 0"):
        model(ids, attention_mask=mask, labels=ids)
    # with -100 there, the row contributes nothing: the loss is row 0's loss
    labels = ids.clone()
    labels[1] = -100
    with torch.no_grad():
        both = model(ids, attention_mask=mask, labels=labels)
        alone = model(ids[:1], labels=ids[:1])
    torch.testing.assert_close(both.loss, alone.loss, rtol=1e-5, atol=1e-6)


def test_inputs_and_heads_on_other_devices_or_dtypes_are_refused():
    ids = ids_with_num((1, 5), num_at=())
    model = wrap()
    with pytest.raises(ValueError, match="input_ids is on device meta but the model's embedding is on cpu"):
        model(ids.to("meta"))  # torch would read garbage memory here, silently
    with pytest.raises(ValueError, match="numeric_values is on device meta"):
        model(ids, torch.zeros(1, 5, device="meta"))
    model.abduction.to("meta")
    with pytest.raises(ValueError, match="abduction head is on device meta but the backbone's lm_head .* is on cpu"):
        model(ids)
    model = wrap()
    model.action.to(torch.float64)
    with pytest.raises(ValueError, match="adapter heads have mixed dtypes .*'action': torch.float64"):
        model(ids)


# =========================================================================== config
@pytest.mark.parametrize("kwargs, message", [
    (dict(gamma0=-1.0), "gamma0 must be > 0"),
    (dict(gamma0=1e300), r"gamma0 must be at most 1e\+30 in magnitude .* got 1e\+300"),
    (dict(gamma0=3e38), r"gamma0 must be at most 1e\+30"),
    (dict(b_noise_init=-1e31), r"b_noise_init must be at most 1e\+30 in magnitude"),
    (dict(threshold_init=-1e39), r"threshold_init must be at most 1e\+18 in magnitude .* got -1e\+39"),
    (dict(threshold_init=1e20), r"threshold_init must be at most 1e\+18 in magnitude"),
    (dict(threshold_init=float("nan")), "threshold_init must be a finite number"),
    (dict(b_noise_init=float("inf")), "b_noise_init must be a finite number"),
    (dict(alpha=-0.1), r"alpha must be in \[0, 1\], got -0.1"),
    (dict(alpha=1.01), r"alpha must be in \[0, 1\], got 1.01"),
    (dict(alpha=float("nan")), "alpha must be a finite number"),
    (dict(reg_weight=-0.5), r"reg_weight \(lambda\) must be >= 0, got -0.5"),
    (dict(causal_size=-3), "causal_size must be a positive integer or None, got -3"),
    (dict(causal_size=2.5), "causal_size must be a positive integer or None, got 2.5"),
    (dict(scale_floor=0.0), r"scale_floor must be in \(0, 1\)"),
    (dict(direction_std=0.0), "direction_std must be > 0"),
    (dict(lora=dict(dropout=1.0)), r"lora.dropout must be in \[0, 1\)"),
    (dict(lora=dict(target_modules=[])), "lora.target_modules is empty"),
])
def test_invalid_config_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CausalAdapterConfig(**kwargs)


def test_lora_target_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match=r"LoRA target_modules \['nope_proj'\] do not match the backbone"):
        wrap(lora=LoraSettings(target_modules=["nope_proj"]))


@pytest.mark.parametrize("cfg", [dict(gamma0=1e-30), dict(gamma0=1e-300, b_noise_init=0.0), dict(gamma0=1e30),
                                 dict(b_noise_init=-1e30), dict(threshold_init=1e18), dict(threshold_init=-1e18)],
                         ids=lambda c: ",".join(f"{k}={v:g}" for k, v in c.items()))
def test_extreme_valid_config_values_stay_finite(cfg):
    model = wrap(**cfg)
    ids = ids_with_num((1, 6))
    vals = torch.zeros(1, 6)
    vals[0, 3] = 5.0
    out = model(ids, vals, labels=ids)
    assert torch.isfinite(out.loss) and torch.isfinite(out.scale_U).all()
    out.loss.backward()
    assert all_grads_finite(model)


# =========================================================================== models
def test_bf16_base_fp32_adapter_trains_saves_and_reloads(tmp_path):
    base = small_vocab_qwen(dtype=torch.bfloat16, num_layers=1)
    model = wrap(base)
    assert model.abduction.loc.weight.dtype == torch.float32 and model.W_cls.dtype == torch.bfloat16
    ids = ids_with_num((2, 6))
    vals = torch.zeros(2, 6)
    vals[0, 3] = 12.5
    opt = torch.optim.Adam([p for _, p in model.trainable_parameters()], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        out = model(ids, vals, labels=ids)
        assert torch.isfinite(out.loss)
        out.loss.backward()
        assert all_grads_finite(model)
        opt.step()
    model.save_pretrained(tmp_path / "a")
    saved = load_file(str(tmp_path / "a" / WEIGHTS_NAME))
    assert saved["action.num_row"].dtype == torch.float32 and saved["action.num_row"].shape == (32,)
    again = CausalModel.from_pretrained(small_vocab_qwen(dtype=torch.bfloat16, num_layers=1), tmp_path / "a")
    with torch.no_grad():
        a, b = model(ids, vals, labels=ids, return_scores=True), again(ids, vals, labels=ids, return_scores=True)
    for name in ("loss", "loc_U", "scale_U", "loc_Y", "scale_Y", "loc_S", "scale_S"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# =========================================================================== artifacts
@pytest.fixture
def saved_adapter(tmp_path):
    model = wrap(small_vocab_qwen(num_layers=1))
    with torch.no_grad():
        model.action.b_cls.normal_(0, 1, generator=torch.Generator().manual_seed(3))
    d = tmp_path / "adapter"
    model.save_pretrained(d)
    return model, d


def test_flipped_byte_in_weights_is_detected(saved_adapter):
    _, d = saved_adapter
    w = d / WEIGHTS_NAME
    data = bytearray(w.read_bytes())
    data[-5] ^= 0x40  # a byte of the last tensor's data: safetensors itself cannot notice
    w.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"adapter_model.safetensors' is truncated or corrupted: its sha256 differs"):
        CausalModel.from_pretrained(small_vocab_qwen(num_layers=1), d)


def test_garbage_weights_without_checksum_are_detected(saved_adapter):
    _, d = saved_adapter
    meta = json.loads((d / CONFIG_NAME).read_text())
    del meta["weights_sha256"]  # e.g. an adapter written by an older version
    (d / CONFIG_NAME).write_text(json.dumps(meta))
    (d / WEIGHTS_NAME).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ValueError, match="truncated or corrupted"):
        CausalModel.from_pretrained(small_vocab_qwen(num_layers=1), d)


def test_missing_weights_and_invalid_config_json(saved_adapter):
    _, d = saved_adapter
    (d / CONFIG_NAME).write_text("{ not json")
    with pytest.raises(ValueError, match=r"adapter_config.json' is not valid JSON"):
        CausalModel.from_pretrained(small_vocab_qwen(num_layers=1), d)
    (d / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=r"adapter_model.safetensors' is missing"):
        CausalModel.from_pretrained(small_vocab_qwen(num_layers=1), d)


def test_non_finite_adapter_is_never_saved_nor_loaded(saved_adapter):
    model, d = saved_adapter
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with torch.no_grad():
        model.action.w_reg[3] = float("nan")
    with pytest.raises(ValueError, match=r"refusing to save .*'action.w_reg' contains NaN or inf \(1 of 32 entries\)"):
        model.save_pretrained(d)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # the previous adapter is intact
    assert sorted(p.name for p in d.parent.iterdir()) == ["adapter"]
    # a file written by other means with an inf inside is refused on load
    tensors = load_file(str(d / WEIGHTS_NAME))
    tensors["action.b_cls"][7] = float("inf")
    save_file(tensors, str(d / WEIGHTS_NAME))
    meta = json.loads((d / CONFIG_NAME).read_text())
    del meta["weights_sha256"]
    (d / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"'action.b_cls' contains NaN or inf \(1 of 320 entries\)"):
        read_adapter_files(d)


def test_adapter_onto_base_with_other_vocab_size(saved_adapter):
    _, d = saved_adapter
    meta = json.loads((d / CONFIG_NAME).read_text())
    assert meta["num_token_id"] == NUM and meta["vocab_size"] == 320
    with pytest.raises(ValueError, match="vocab_size=320.*vocab_size=400"):
        CausalModel.from_pretrained(small_vocab_qwen(vocab_size=400, num_layers=1), d)


# =========================================================================== data
def test_empty_data_is_refused(tmp_path, ntok):
    from causal_adapter.data.pipeline import load_text_dataset, tokenize_dataset
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import train

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n  \n")
    for f in (empty, blank):
        with pytest.raises(ValueError, match=rf"{f.name}: the file is empty \(no JSON rows\)"):
            load_text_dataset(str(f), cache_dir=str(tmp_path / "cache"))
    assert len(tokenize_dataset(datasets.Dataset.from_dict({"text": []}), ntok)) == 0
    rows = datasets.Dataset.from_dict({k: [] for k in ("input_ids", "numeric_values", "labels", "label_values")})
    with pytest.raises(ValueError, match="the training set is empty"):
        train(wrap(small_vocab_qwen(num_layers=1)),
              TrainConfig(output_dir=str(tmp_path / "out"), plot=False, progress=False, max_steps=2),
              train_dataset=rows)


# =========================================================================== faults: kill -9 during training
def _kill_rows(n=16):
    g = torch.Generator().manual_seed(0)
    out = {k: [] for k in ("input_ids", "numeric_values", "labels", "label_values")}
    for i in range(n):
        length = 5 + i % 3
        ids = torch.randint(0, 290, (length,), generator=g)
        ids[2] = NUM
        vals = torch.zeros(length)
        vals[2] = 1.5 * i - 3.0
        for k, v in (("input_ids", ids), ("numeric_values", vals), ("labels", ids), ("label_values", vals)):
            out[k].append(v.tolist())
    return datasets.Dataset.from_dict(out)


KILL_STEPS = 40


def _train_child(out_dir: str, resume: bool) -> None:
    """Forked child: one training run (resumed from the latest checkpoint if asked); exits, never returns."""
    code = 1
    try:
        from causal_adapter.training.config import TrainConfig
        from causal_adapter.training.loop import train

        torch.set_num_threads(1)  # the same reduction order in every run
        torch.manual_seed(0)  # peft draws the LoRA init from the global RNG
        model = wrap(small_vocab_qwen(num_layers=1), learnable_threshold=True, threshold_mode="vector",
                     lora=LoraSettings(r=2, alpha=4, dropout=0.1, target_modules=["q_proj", "v_proj"]))
        config = TrainConfig(output_dir=out_dir, plot=False, progress=False, max_steps=KILL_STEPS, save_steps=1,
                             save_total_limit=2, logging_steps=1, per_device_train_batch_size=4,
                             learning_rate=1e-2, resume_from_checkpoint="latest" if resume else None)
        train(model, config, train_dataset=_kill_rows())
        code = 0
    except BaseException:  # noqa: BLE001 - reported through the exit code
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def test_kill_9_during_training_resumes_to_the_same_adapter(tmp_path):
    """SIGKILL a training run (save_steps=1) at random moments, between and during checkpoint saves;
    each restart resumes from the latest complete checkpoint; the final adapter equals, bit for bit,
    the adapter of an uninterrupted run."""
    import accelerate.utils  # noqa: F401  (imported once here, not in every forked child)
    import peft  # noqa: F401
    import tqdm.auto  # noqa: F401
    from transformers import get_scheduler  # noqa: F401

    import causal_adapter.training.metrics  # noqa: F401
    from causal_adapter.training.checkpoints import list_checkpoints

    ctx = mp.get_context("fork")

    def run(out_dir, resume, kill_after_new_checkpoint=None):
        proc = ctx.Process(target=_train_child, args=(str(out_dir), resume))
        proc.start()
        if kill_after_new_checkpoint is None:
            deadline = time.monotonic() + 240
            while latest_step(out_dir) < 1 and proc.is_alive() and time.monotonic() < deadline:
                time.sleep(0.002)
            t_first = time.monotonic()
            proc.join(240)
            assert proc.exitcode == 0, f"training child failed (exit {proc.exitcode})"
            return (time.monotonic() - t_first) / (KILL_STEPS - 1)  # seconds per step (checkpoint included)
        before, delay = kill_after_new_checkpoint
        deadline = time.monotonic() + 120
        while latest_step(out_dir) <= before and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL, f"child ended before the kill (exit {proc.exitcode})"

    def latest_step(out_dir):
        ckpts = list_checkpoints(out_dir)
        return int(ckpts[-1].name.rsplit("-", 1)[1]) if ckpts else 0

    step_time = run(tmp_path / "full", resume=False)
    expected = load_file(str(tmp_path / "full" / "adapter" / WEIGHTS_NAME))

    cut = tmp_path / "cut"
    cut.mkdir()
    rng = random.Random(0)
    kills, steps_at_kill, mid_save, seen_tmps = 8, [], 0, set()
    for _ in range(kills):
        before = latest_step(cut)
        run(cut, resume=True, kill_after_new_checkpoint=(before, rng.uniform(0.0, 2.0) * step_time))
        after = latest_step(cut)
        assert after > before  # progress between kills
        steps_at_kill.append(after)
        tmps = {p.name for p in cut.iterdir() if ".tmp-" in p.name}
        mid_save += bool(tmps - seen_tmps)  # a new temporary directory: killed inside an atomic checkpoint write
        seen_tmps |= tmps
        read_adapter_files(list_checkpoints(cut)[-1])  # the checkpoint a resume uses is complete
    assert steps_at_kill[-1] < KILL_STEPS, "the kills must land before the end of the run"
    run(cut, resume=True)
    got = load_file(str(cut / "adapter" / WEIGHTS_NAME))
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    assert not any(".tmp-" in p.name for p in cut.iterdir())  # stale temporary directories were removed
    print(f"kill -9 during training: {kills} kills at checkpoints {steps_at_kill}, {mid_save} inside a save "
          f"({1000 * step_time:.0f} ms per step); final adapter bit-identical")


def test_diverged_training_stops_with_a_clear_error_and_saves_nothing(tmp_path):
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import train

    model = wrap(small_vocab_qwen(num_layers=1))
    with torch.no_grad():
        model.action.b_reg.fill_(float("nan"))  # what a diverged step leaves behind
    out = tmp_path / "out"
    with pytest.raises(FloatingPointError, match=r"non-finite loss nan at step 1 \(loss_cls=[\d.]+, loss_reg=nan\)"):
        # regression_init="none": the ridge warm start would overwrite the broken b_reg
        train(model, TrainConfig(output_dir=str(out), plot=False, progress=False, max_steps=2, save_steps=1,
                                 per_device_train_batch_size=4, regression_init="none"), train_dataset=_kill_rows(8))
    assert not (out / "adapter").exists() and not any(out.glob("checkpoint-*"))
    with pytest.raises(ValueError, match="refusing to save the adapter: adapter tensor 'action.b_reg' contains NaN"):
        model.save_pretrained(tmp_path / "nan-adapter")
    assert not (tmp_path / "nan-adapter").exists()


# =========================================================================== numerics
def test_text_values_up_to_float32_max_train_finitely(real_model, ntok):
    text = "a 3.4028234663852886e38 b -3.4e38 c 1e39 d 3.4e38"
    batch = ntok([text])
    vals = batch["numeric_values"][0]
    nums = vals[batch["input_ids"][0] == ntok.num_token_id].tolist()
    assert nums == [FLOAT32_MAX, torch.tensor(-3.4e38).item(), torch.tensor(3.4e38).item()]  # 1e39 stayed text
    assert "1e39" in ntok.decode(batch["input_ids"][0], vals)
    real_model.zero_grad(set_to_none=True)
    out = real_model(**batch, labels=batch["input_ids"])
    assert torch.isfinite(out.loss) and torch.isfinite(out.loss_reg) and out.loss_reg.item() > 0
    assert torch.isfinite(out.loc_U).all()
    out.loss.backward()
    assert all_grads_finite(real_model)
    phi = real_model.numeric_embedding(torch.tensor([FLOAT32_MAX]))
    d_norm = real_model.numeric_embedding.direction.norm().item()
    assert phi.norm().item() == pytest.approx(math.log1p(FLOAT32_MAX) * d_norm, rel=1e-5)  # 88.72 |d|, not inf


def test_float64_values_up_to_1e300_are_accepted_and_finite():
    model = wrap()
    ids = ids_with_num((1, 6), num_at=((0, 2), (0, 4)))
    vals = torch.zeros(1, 6, dtype=torch.float64)
    vals[0, 2], vals[0, 4] = 1e300, -1e300
    phi = model.numeric_embedding(vals)
    assert phi.dtype == torch.float32 and torch.isfinite(phi).all()
    d_norm = model.numeric_embedding.direction.norm().item()
    assert phi[0, 2].norm().item() == pytest.approx(math.log1p(1e300) * d_norm, rel=1e-5)  # 690.8 |d|
    out = model(ids, vals, labels=ids)
    assert torch.isfinite(out.loss) and torch.isfinite(out.loc_U).all()
    # the regression term, written out in float64 from the outputs: target 1e300 is far but finite
    with torch.no_grad():
        s = model(ids, vals, return_scores=True)
    p_num = ovr_probability(s.loc_S[0, [1, 3], NUM].double(), s.scale_S[0, [1, 3], NUM].double(),
                            model.action.thresholds.double())
    nll = cauchy_nll(vals[0, [2, 4]], s.loc_Y[0, [1, 3]].double(), s.scale_Y[0, [1, 3]].double())
    expected = (p_num * nll).sum() / 2
    assert nll.min().item() > 1300  # ~ 2 ln(1e300)
    assert out.loss_reg.item() == pytest.approx(expected.item(), rel=1e-4)
    out.loss.backward()
    assert all_grads_finite(model)


def _t_grid_inputs(dtype=torch.float32):
    """Rows i with scale s_i in [1e-6, 1e6], columns k with t_k in [-1e8, 1e8]: z_ik = s_i t_k,
    scale_S_ik = s_i exactly (C = 2: loc_U_i = [s_i, 0], scale_U'_i = [0, s_i], W_k = [t_k, 1])."""
    t = torch.cat([-torch.logspace(8, -8, 9), torch.zeros(1), torch.logspace(-8, 8, 9)]).to(dtype)
    s = torch.logspace(-6, 6, 7).to(dtype)
    loc_U = torch.stack([s, torch.zeros_like(s)], 1).requires_grad_()
    scale_Up = torch.stack([torch.zeros_like(s), s], 1).requires_grad_()
    W = torch.stack([t, torch.ones_like(t)], 1).requires_grad_()
    b = torch.zeros(len(t), dtype=dtype, requires_grad=True)
    labels = torch.arange(len(s)) * 3 % len(t)  # targets in both tails and at t = 0
    return loc_U, scale_Up, W, b, labels, s, t


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("fn", [fused_ovr_loss, reference_ovr_loss], ids=["fused", "reference"])
def test_ovr_loss_finite_for_t_up_to_1e8_and_scales_down_to_1e_6(fn, autocast):
    loc_U, scale_Up, W, b, labels, s, t = _t_grid_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(loc_U, scale_Up, W, b, torch.tensor(0.0), labels, scale_floor=1e-6)
    grads = torch.autograd.grad(loss, (loc_U, scale_Up, W, b))
    assert torch.isfinite(loss) and loss.item() > 0
    for g in grads:
        assert torch.isfinite(g).all()
    if not autocast:  # the target at t = -1e8 costs -log P ~ log(pi 1e8) = 19.6, not inf
        ref = reference_ovr_loss(loc_U.double(), scale_Up.double(), W.double(), b.double(), 0.0, labels,
                                 scale_floor=1e-6)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-4)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_gated_nll_finite_far_from_target(autocast):
    s = torch.logspace(-6, 6, 7)
    t = torch.cat([-torch.logspace(8, -8, 5), torch.logspace(-8, 8, 5)])
    S, T = torch.meshgrid(s, t, indexing="ij")
    S, T = S.reshape(-1), T.reshape(-1)
    y = torch.cat([torch.zeros_like(S), torch.full_like(S, 1e30), torch.full_like(S, FLOAT32_MAX),
                   torch.full_like(S, -FLOAT32_MAX)])
    loc = torch.cat([-T * S, torch.zeros_like(S), torch.zeros_like(S), torch.zeros_like(S)]).requires_grad_()
    scale = torch.cat([S] * 4).requires_grad_()
    labels = torch.full_like(y, NUM, dtype=torch.long)
    for alpha, p in ((0.0, 0.5), (1.0, 0.0), (0.3, 1e-30)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = gated_regression_loss(loc, scale, y, labels, NUM, torch.full_like(y, p), alpha)
        g_loc, g_scale = torch.autograd.grad(loss, (loc, scale))
        assert torch.isfinite(loss) and torch.isfinite(g_loc).all() and torch.isfinite(g_scale).all()
    nll = cauchy_nll(torch.tensor([1e30]), torch.tensor([0.0]), torch.tensor([1e-6]))
    assert nll.item() == pytest.approx(math.log(math.pi) + 2 * math.log(1e30) - math.log(1e-6), rel=1e-6)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_model_loss_finite_with_target_1e30_far_from_loc_Y(autocast):
    model = wrap(small_vocab_qwen(num_layers=1))
    ids = ids_with_num((2, 6), num_at=((0, 3), (1, 2)))
    vals = torch.zeros(2, 6)
    vals[0, 3], vals[1, 2] = 1e30, -FLOAT32_MAX
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, vals, labels=ids, return_scores=True)
    assert out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss) and torch.isfinite(out.loss_reg)
    # gate * NLL written out in float64 from the outputs (alpha = 0: gate = P_num)
    rows = torch.tensor([0, 1]), torch.tensor([2, 1])
    p_num = ovr_probability(out.loc_S[rows[0], rows[1], NUM].double(), out.scale_S[rows[0], rows[1], NUM].double(),
                            model.action.thresholds.double())
    nll = cauchy_nll(torch.tensor([1e30, -FLOAT32_MAX], dtype=torch.float64),
                     out.loc_Y[rows].double(), out.scale_Y[rows].double())
    assert nll.min().item() > 130
    # (under autocast loc_S is bf16 while the loss takes P_num from loc_U in float32: 1% apart)
    assert out.loss_reg.item() == pytest.approx(((p_num * nll).sum() / 2).item(), rel=1e-2 if autocast else 1e-5)
    out.loss.backward()
    assert all_grads_finite(model)
    assert symlog(torch.tensor(1e30)).item() == pytest.approx(math.log1p(1e30))


def test_ovr_log_probs_gradient_finite_for_huge_z():
    """z^2 overflows float32 beyond 1.8e19: the closed-form backward must not form it."""
    import mpmath

    from causal_adapter.modeling.cauchy import ovr_log_probs

    zs, ss = [-1e20, 1e20, -3e38, 3e38, -1e20], [10.0, 10.0, 1.0, 1e-6, 1e25]
    z = torch.tensor(zs, requires_grad=True)
    s = torch.tensor(ss, requires_grad=True)
    log_p, log_1mp = ovr_log_probs(z, s)
    assert torch.isfinite(log_p).all() and torch.isfinite(log_1mp).all()
    gz, gs = torch.autograd.grad((log_p + 2 * log_1mp).sum(), (z, s))
    assert torch.isfinite(gz).all() and torch.isfinite(gs).all()
    mpmath.mp.dps = 60
    for k, (zk, sk) in enumerate(zip(z.tolist(), s.tolist())):  # the float32 inputs, exactly
        def f(zz, ss):
            p = mpmath.mpf(1) / 2 + mpmath.atan(zz / ss) / mpmath.pi
            return mpmath.log(p) + 2 * mpmath.log(1 - p)
        want_z = mpmath.diff(lambda v: f(v, mpmath.mpf(sk)), mpmath.mpf(zk))
        want_s = mpmath.diff(lambda v: f(mpmath.mpf(zk), v), mpmath.mpf(sk))
        assert gz[k].item() == pytest.approx(float(want_z), rel=1e-5), (zk, sk)
        assert gs[k].item() == pytest.approx(float(want_s), rel=1e-5), (zk, sk)
