"""Packed and padding-free batches (`causal_adapter.data.packing`, `CausalModel.forward` with position_ids and no
attention_mask, `train(..., TrainConfig(packing=True))`, `CausalSFTTrainer(packing=True / padding_free=True)`).

Claims, each failing when its mechanism is removed:

* packed rows give each row's outputs (loc_U, loc_Y, scale_Y), the batch's losses and every gradient (LoRA and
  heads) of the padded batch of the same rows, in fp32, with sdpa and eager attention, packed per row or
  flattened into one row: float32 rounding apart (measured: relative 2.2e-7 for outputs and losses, 9.3e-7 of
  a gradient's norm; the tolerances, `OUTPUT_RTOL` / `GRAD_RTOL`, are ten times those). Without the position
  reset at each row (attention across rows) or without the value head's recent-values restart, outputs differ
  by 0.5-1.3 of their scale, losses by 8e-4-0.1 relative, gradients by 1e4-1e6 times the tolerance;
* the flattening CausalModel.forward does for flash attention (several packed rows into one) changes nothing;
* packing keeps each number's value with its token, bounds rows by max_length, and labels -100 at every row's
  first token (no row predicts the next row's first token); padding gets position ids of its own;
* `recent_values` restarts at a row start and is bit-identical to the unpacked one without starts;
* the product's loop and TRL's trainer run packed / padding-free.
"""
from __future__ import annotations

import random

import pytest
import torch

from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model
from causal_adapter.config import IGNORE_INDEX
from causal_adapter.data.packing import PackedCollator, pack_dataset, pack_rows
from causal_adapter.data.pipeline import NumericCollator
from causal_adapter.modeling.recent_numbers import packed_row_starts, recent_values
from causal_adapter.saving.assets import build_tiny_qwen

NUM = 300  # <NUM> in a 320-row vocabulary
#: packed against padded, fp32, relative (measured maxima over seeds 0-4, sdpa and eager, packed and flattened:
#: loc_U 2.2e-7, loc_Y / scale_Y 1.6e-7, losses 1.4e-7, gradients 9.3e-7 of their norm; eager's outputs are
#: often bit-equal): ten times those
OUTPUT_RTOL = 2e-6
GRAD_RTOL = 1e-5  # of each parameter's gradient norm
GRAD_ATOL = 1e-9  # b_reg's gradient can be ~1e-8 (measured |diff| <= 6.4e-10)


def _rows(n: int, seed: int) -> list[dict]:
    """Tokenised rows of 3-24 tokens, a third of them numbers, the loss from a random point on (a prompt)."""
    g = random.Random(seed)
    rows = []
    for _ in range(n):
        length = g.randint(3, 24)
        ids = [NUM if g.random() < 0.35 else g.randrange(290) for _ in range(length)]
        vals = [round(g.uniform(-80, 80), 2) if t == NUM else 0.0 for t in ids]
        start = g.randint(0, length - 1)
        labels = [IGNORE_INDEX] * start + ids[start:]
        rows.append({"input_ids": ids, "numeric_values": vals, "labels": labels,
                     "label_values": [v if lab != IGNORE_INDEX else 0.0 for v, lab in zip(vals, labels)]})
    return rows


def _model(attn: str, seed: int = 0, arch: str = "qwen2"):
    """A small real Qwen2 with LoRA (gradients through attention) and a value head reading 3 recent numbers."""
    base = build_tiny_qwen(arch, hidden_size=32, num_layers=2, vocab_size=320, seed=seed)
    base.config._attn_implementation = attn
    torch.manual_seed(seed)
    lora = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM, recent_values=3, lora=lora))
    model.action.set_head_units(2.0, 30.0)
    with torch.no_grad():
        model.action.w_recent.copy_(torch.tensor([0.8, -0.5, 0.3]))  # the recent numbers move loc_Y (and L_reg)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # LoRA starts as a no-op: give it a say
                p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(seed))
    return model.train()


def _packed_features(rows: list[dict], max_length: int) -> list[dict]:
    packed = pack_rows({k: [r[k] for r in rows] for k in rows[0]}, max_length)
    return [{k: packed[k][i] for k in packed} for i in range(len(packed["input_ids"]))]


def _run(model, batch: dict) -> tuple:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _per_row(out, batch: dict, tokens_per_row: list[list[int]], pos: torch.Tensor | None = None
             ) -> list[torch.Tensor]:
    """Each original row's outputs [n_i, C + 2] (loc_U, loc_Y, scale_Y), found in a packed or padded batch by
    walking its rows (`tokens_per_row` [row] = the input ids; `pos` the packed rows' position ids, None: a
    padded batch)."""
    found = []
    feats = torch.cat([out.loc_U, out.loc_Y.unsqueeze(-1), out.scale_Y.unsqueeze(-1)], -1).detach()
    for b in range(feats.shape[0]):
        if pos is None:  # padded: one row per batch row
            n = int(batch["attention_mask"][b].sum())
            found.append((batch["input_ids"][b, :n].tolist(), feats[b, :n]))
            continue
        starts = packed_row_starts(pos[b]).nonzero().flatten().tolist() + [pos.shape[1]]
        starts = [0] + [s for s in starts if s > 0]
        for s, e in zip(starts, starts[1:]):
            found.append((batch["input_ids"][b, s:e].tolist(), feats[b, s:e]))
    by_tokens = {}
    for ids, f in found:
        by_tokens.setdefault(tuple(ids), []).append(f)
    return [by_tokens[tuple(ids)].pop(0) for ids in tokens_per_row]


def _differences(model, rows, packed_batch, layout: torch.Tensor | None = None) -> dict:
    """Packed against padded, relative: each row's outputs (max |diff| / max |padded| of loc_U, and of loc_Y and
    scale_Y), the three losses (|diff| / |padded|), the gradients (max over parameters of |diff| / (|padded| *
    GRAD_RTOL + GRAD_ATOL) in norm: <= 1 passes). `layout`: where the packed rows are (default: the batch's own
    position ids)."""
    padded = NumericCollator(0)(rows)
    out_pad, g_pad = _run(model, padded)
    out_pack, g_pack = _run(model, packed_batch)
    ids = [r["input_ids"] for r in rows]
    layout = packed_batch["position_ids"] if layout is None else layout
    a, b = _per_row(out_pad, padded, ids), _per_row(out_pack, packed_batch, ids, layout)
    C = out_pad.loc_U.shape[-1]

    def rel(cols):
        return max(float((x[:, cols] - y[:, cols]).abs().max()) for x, y in zip(a, b)) / max(
            float(x[:, cols].abs().max()) for x in a)

    losses = max(float(((getattr(out_pad, k) - getattr(out_pack, k)) / getattr(out_pad, k)).abs().detach())
                 for k in ("loss", "loss_cls", "loss_reg"))
    assert set(g_pad) == set(g_pack) and any("lora_" in n for n in g_pad)
    grads = max(float((g_pad[n] - g_pack[n]).norm() / (g_pad[n].norm() * GRAD_RTOL + GRAD_ATOL)) for n in g_pad)
    return {"loc_U": rel(slice(0, C)), "loc_Y, scale_Y": rel(slice(C, C + 2)), "losses": losses, "grads": grads}


def _assert_same(d: dict) -> None:
    assert max(d["loc_U"], d["loc_Y, scale_Y"], d["losses"]) <= OUTPUT_RTOL and d["grads"] <= 1.0, d


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("flatten", [False, True], ids=["packed", "padding_free"])
def test_packed_rows_give_the_padded_batch_outputs_losses_and_gradients(attn, flatten):
    model = _model(attn)
    rows = _rows(9, seed=1)
    batch = PackedCollator(0, flatten=flatten)(_packed_features(rows, 48))
    assert batch["input_ids"].shape[0] == (1 if flatten else 3) and "attention_mask" not in batch
    _assert_same(_differences(model, rows, batch))


def test_without_the_position_reset_or_the_recent_values_restart_rows_leak(monkeypatch):
    import causal_adapter.model.causal_model as model_module

    model = _model("sdpa")
    rows = _rows(9, seed=1)
    batch = PackedCollator(0)(_packed_features(rows, 48))
    unreset = {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])}
    d = _differences(model, rows, unreset, batch["position_ids"])  # one sequence: attention across rows
    assert d["loc_U"] > 1e-3 and d["grads"] > 100, d
    full = recent_values
    monkeypatch.setattr(model_module, "recent_values", lambda *args: full(*args[:5]))  # row_starts dropped
    d = _differences(model, rows, batch)
    assert d["loc_U"] <= OUTPUT_RTOL and d["loc_Y, scale_Y"] > 1e-3 and d["losses"] > 1e-5 and d["grads"] > 100, d


def test_flattening_for_flash_attention_changes_nothing(monkeypatch):
    """Varlen flash attention reads packed rows from one row's position ids: forward flattens [B, S] packed rows
    into [1, B * S] there. Forced here on sdpa, whose packed mask it must not change."""
    import causal_adapter.model.causal_model as model_module

    model = _model("sdpa")
    rows = _rows(9, seed=2)
    batch = PackedCollator(0)(_packed_features(rows, 48))
    calls = []
    monkeypatch.setattr(model_module, "is_flash_attention", lambda decoder: calls.append(1) or True)
    _assert_same(_differences(model, rows, batch))
    assert calls


def _segment(row: dict) -> tuple:
    """A row's tokens, values, and labels after its first (which packing sets to -100)."""
    return (tuple(row["input_ids"]), tuple(row["numeric_values"]), tuple(row["labels"][1:]),
            tuple(row["label_values"][1:]))


def test_pack_rows_keeps_values_with_their_tokens_and_labels_no_row_start():
    rows = _rows(40, seed=3)
    packed = _packed_features(rows, 30)
    assert all(len(p["input_ids"]) <= 30 for p in packed)
    assert len(packed) < len(rows) / 2  # rows of 3-24 tokens: several to a packed row
    seen = []
    for p in packed:
        for key in ("numeric_values", "labels", "label_values", "position_ids"):
            assert len(p[key]) == len(p["input_ids"])
        starts = [i for i, q in enumerate(p["position_ids"]) if q == 0] + [len(p["input_ids"])]
        assert starts[0] == 0
        for s, e in zip(starts, starts[1:]):
            assert p["position_ids"][s:e] == list(range(e - s))
            assert p["labels"][s] == IGNORE_INDEX and p["label_values"][s] == 0.0
            seen.append(_segment({k: p[k][s:e] for k in p}))
    assert sorted(seen) == sorted(_segment(r) for r in rows)  # every row once, whole, its values with it
    # a row longer than max_length keeps its first max_length tokens
    (long_row,) = _packed_features([{**rows[0], **{k: v * 5 for k, v in rows[0].items()}}], 10)
    assert long_row["input_ids"] == (rows[0]["input_ids"] * 5)[:10]


def test_collator_pads_with_rows_of_their_own():
    feats = [{"input_ids": [5, NUM, 7], "numeric_values": [0.0, 2.5, 0.0], "labels": [5, NUM, 7]},
             {"input_ids": [8, 9], "labels": [8, 9], "position_ids": [0, 0]}]
    batch = PackedCollator(1, pad_to_multiple_of=4)(feats)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 0, 0, 1]]
    assert batch["labels"].tolist() == [[-100, NUM, 7, -100], [-100, -100, -100, -100]]
    assert batch["label_values"].tolist()[0] == [0.0, 2.5, 0.0, 0.0]
    assert batch["input_ids"].tolist() == [[5, NUM, 7, 1], [8, 9, 1, 1]]
    flat = PackedCollator(1, flatten=True)(feats)
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 0]] and flat["input_ids"].shape == (1, 5)


def test_recent_values_restart_at_row_starts_and_are_unchanged_without():
    ids = torch.tensor([[9, 1, 9, 9, 2, 9, 3, 9]])
    vals = torch.tensor([[1.0, 0, 2.0, 3.0, 0, 4.0, 0, 5.0]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])  # rows [0, 4), [4, 7), [7, 8)
    starts = packed_row_starts(pos)
    assert starts.tolist() == [[False, False, False, False, True, False, False, True]]
    r = torch.nan_to_num(recent_values(ids, vals, 9, 2, row_starts=starts), nan=-1.0)
    assert r.tolist() == [[[1, -1], [1, -1], [2, 1], [3, 2], [-1, -1], [4, -1], [4, -1], [5, -1]]]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (3, 50), generator=g)
    vals = torch.where(ids == 3, torch.randn(3, 50, generator=g), torch.zeros(3, 50))
    before = torch.randn(3, 4, generator=g)
    plain = recent_values(ids, vals, 3, 4, before)
    unpacked = recent_values(ids, vals, 3, 4, before, packed_row_starts(torch.arange(50).expand(3, 50)))
    assert torch.equal(plain.nan_to_num(nan=7.0), unpacked.nan_to_num(nan=7.0))


def test_linear_attention_families_refuse_packed_rows():
    model = get_causal_model(build_tiny_qwen("qwen3_next", hidden_size=32, num_layers=2, vocab_size=320),
                             CausalAdapterConfig(num_token_id=NUM))
    batch = PackedCollator(0)(_packed_features(_rows(4, seed=4), 48))
    with pytest.raises(ValueError, match="linear-attention"):
        model(**batch)


def test_pack_dataset_maps_a_dataset():
    import datasets

    rows = _rows(12, seed=5)
    ds = datasets.Dataset.from_list([{**r, "target": 1.0} for r in rows])
    packed = pack_dataset(ds, 32)
    assert packed.column_names == ["input_ids", "numeric_values", "labels", "label_values", "position_ids"]
    assert sum(len(x) for x in packed["input_ids"]) == sum(len(r["input_ids"]) for r in rows)
    assert max(len(x) for x in pack_dataset(ds)["input_ids"]) <= max(len(r["input_ids"]) for r in rows)


def test_train_runs_packed(tmp_path):
    from causal_adapter.training.loop import train

    from test_train import quick_config

    cfg = quick_config(tmp_path, packing=True, max_length=160, tiny_hidden_size=32, tiny_layers=1,
                       max_train_samples=16, max_eval_samples=4, max_steps=2, per_device_train_batch_size=2,
                       recent_values=4)
    seen = []
    result = train(config=cfg, callbacks=[lambda state, logs: seen.append(logs)])
    assert result.global_step == 2 and result.eval_metrics is not None
    assert all(torch.isfinite(torch.tensor(logs["loss"])) for logs in seen if "loss" in logs)
    assert (result.adapter_dir / "causal_adapter_model.safetensors").is_file()


@pytest.mark.parametrize("option", [{"packing": True, "max_length": 200}, {"padding_free": True}],
                         ids=["packing", "padding_free"])
def test_sft_trainer_runs_packed_and_padding_free(tmp_path, qwen_tokenizer, option):
    trl = pytest.importorskip("trl")
    from causal_adapter.data.corpora import build_corpus
    from causal_adapter.training.sft import CausalSFTTrainer

    tok = qwen_tokenizer
    model = get_causal_model(build_tiny_qwen("qwen2", hidden_size=32, num_layers=1), CausalAdapterConfig(),
                             tokenizer=tok)
    data = build_corpus("sunspots")
    shapes = []
    model.register_forward_pre_hook(lambda module, args, kw: shapes.append(  # Trainer's calls: keywords only
        (tuple(kw["input_ids"].shape), kw.get("attention_mask") is None, kw.get("position_ids") is not None))
        if "input_ids" in kw else None, with_kwargs=True)
    args = trl.SFTConfig(str(tmp_path), max_steps=2, learning_rate=1e-2, use_cpu=True, bf16=False, report_to=[],
                         save_strategy="no", per_device_train_batch_size=4, **option)
    trainer = CausalSFTTrainer(model=model, args=args, train_dataset=data["train"].select(range(24)),
                               eval_dataset=data["validation"].select(range(4)), processing_class=tok)
    assert trainer.args.packing == option.get("packing", False)  # the user's settings, as given
    trainer.train()
    flat = [s for s in shapes if s[1] and s[2]]
    assert flat and all(s[0][0] == 1 for s in flat), shapes  # one flattened row per batch, no attention_mask
    if option.get("packing"):
        assert len(trainer.train_dataset) < 24 and max(s[0][1] for s in flat) <= 4 * 200
    assert model.causal_config.value_calibration is not None  # the value head's fits ran on the unpacked rows
