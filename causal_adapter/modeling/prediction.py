"""Values with their intervals for a list of prompts (`CausalModel.predict_values`, `causal-adapter predict`).

    model.predict_values(["Yearly sunspot numbers. ... 1978: 92.5; 1979: "], tokenizer=tok, levels=(0.5, 0.9))
    -> [{"row": 0, "value": 124.7, "scale": 15.3, "p_num": 0.98, "lower_50": ..., "upper_50": ..., ...}]

The value is read where the next token of the prompt would be a number: the head of the LAST
prompt position, exactly the position whose loc_Y the evaluation scores when a completion follows
the prompt. So a prompt must end where the number starts, as the training data writes it (the
built-in corpora put the space before the value in the completion: end the prompt with ": ", or
give the completion and let `causal-adapter predict` add its text before the number; an adapter trained
by `train()` knows the token its training data wrote before a number and appends it to a prompt that
ends without one, as `generate` writes it, so ``"1979:"`` and ``"1979: "`` give the same row). `p_num`
says how sure the model is that a number comes there: a low one flags a prompt that ends elsewhere.

One forward per batch of left-padded prompts (no generation, no [B, V] scores).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ..numbers import pad_batch
from .generation import text_prompts_tokenizer
from .heads import full_precision
from .intervals import check_level
from .loss import num_probability
from .series import RowSeries, prompt_series
from .series_ar import mixed_locations

DEFAULT_LEVELS = (0.5, 0.9)


def level_name(level: float) -> str:
    """The suffix of a level's columns: 0.5 -> "50", 0.975 -> "97.5"."""
    return format(round(100 * level, 6), "g")


def check_levels(levels: Sequence[float]) -> tuple[float, ...]:
    """Levels in (0, 1), each once, in the given order; a ValueError names a bad one."""
    if isinstance(levels, (int, float)):
        levels = (levels,)
    out: list[float] = []
    for q in levels:
        q = check_level(q)
        if level_name(q) not in {level_name(p) for p in out}:
            out.append(q)
    if not out:
        raise ValueError("give at least one interval level in (0, 1), e.g. levels=(0.5, 0.9)")
    return tuple(out)


def prediction_columns(levels: Sequence[float]) -> list[str]:
    """Column names of `predict_values`'s rows, in output order."""
    cols = ["row", "value", "scale", "p_num"]
    for q in check_levels(levels):
        n = level_name(q)
        cols += [f"lower_{n}", f"upper_{n}", f"raw_lower_{n}", f"raw_upper_{n}"]
    return cols + ["series", "support", "transform"]


def encode_prompts(model, ntok, prompts: Sequence[str]) -> dict:
    """Left-padded encodings [B, S] of `prompts`, each ending where training fitted the value head: with the
    adapter's number layout (`CausalAdapterConfig.number_prefix_id`), a prompt whose last token never preceded
    a training number (``"...: "`` does, ``"...:"`` does not) gets the prefix appended, exactly as `generate`
    writes it before the number; so both read the value at the same position."""
    encs = ntok.encode_batch(list(prompts), return_offsets=False)
    cfg = model.causal_config
    ids = [e.input_ids for e in encs]
    vals = [e.numeric_values for e in encs]
    if cfg.number_prefix_id is not None:
        contexts = set(cfg.number_contexts)
        for i, row in enumerate(ids):
            if row and row[-1] not in contexts:
                ids[i], vals[i] = row + [cfg.number_prefix_id], vals[i] + [0.0]
    return pad_batch(ids, vals, ntok.pad_token_id, padding_side="left")


def encoded_batches(model, ntok, prompts: Sequence[str], batch_size: int):
    """(start, `encode_prompts` of prompts[start:start + batch_size]) per batch, in order; a ValueError names a
    prompt that encodes to no token (`predict_values` and `horizon.predict_horizon` read the same batches)."""
    for start in range(0, len(prompts), batch_size):
        enc = encode_prompts(model, ntok, prompts[start:start + batch_size])
        if bool((enc["attention_mask"].sum(-1) == 0).any()):
            i = start + int((enc["attention_mask"].sum(-1) == 0).nonzero()[0])
            raise ValueError(f"prompt {i} encodes to no token")
        yield start, enc


@torch.no_grad()
def predict_batch(model, enc: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loc_Y, scale_Y, P(<NUM>)) [B] at the last position of left-padded encodings."""
    return predict_forward(model, enc)[:3]


@torch.no_grad()
def predict_forward(model, enc: dict, use_cache: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """`predict_batch`'s (loc_Y, scale_Y, P(<NUM>)) [B] and the forward's `CausalOutput` (with the backbone's cache
    when `use_cache`: a horizon's paths continue from it, `modeling.horizon`)."""
    dev = model.input_device  # the embedding's device; the heads' outputs come back on lm_head's
    ids, vals, mask = (enc[k].to(dev) for k in ("input_ids", "numeric_values", "attention_mask"))
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)  # as generation: padding never changes a row
    out = model(ids, vals, mask, position_ids=position_ids, use_cache=use_cache)
    loc_U, scale_U = out.loc_U[:, -1], out.scale_U[:, -1]
    act = model.action
    with full_precision(loc_U.device):  # as in forward, whatever autocast the caller runs under
        p_num = num_probability(loc_U, act.noisy_scale(scale_U), act.num_weight(model.W_cls),
                                act.b_cls[model.num_token_id], act.num_threshold(), scale_floor=act.scale_floor)
    return out.loc_Y[:, -1].double(), out.scale_Y[:, -1].double(), p_num.double(), out


def batch_series(model, enc: dict, out) -> RowSeries:
    """The `series.RowSeries` of a batch of prompts (`encode_prompts`) whose forward is `out`: each row's series
    found by its text, its support and width factor (`CausalAdapterConfig.value_series`)."""
    recent = None if out.recent is None else out.recent[:, -1]
    series = prompt_series(enc["input_ids"], enc["numeric_values"], enc.get("attention_mask"), recent,
                           model.num_token_id, model.causal_config.value_series, out.loc_Y[:, -1].double())
    series.log = None if out.value_log is None else out.value_log[:, -1].cpu()  # the rows the head told on log y
    return series


def prediction_rows(model, loc: torch.Tensor, scale: torch.Tensor, p_num: torch.Tensor, levels: tuple[float, ...],
                    start: int, series: RowSeries | None = None) -> list[dict[str, Any]]:
    """`predict_values`' dicts of rows start.. from the heads at their last position, loc / scale / p_num [n];
    `series` (`batch_series`): each row's location is its series' mix with its own AR (`series_ar`), its width
    factor multiplies scale_Y (the calibrated intervals'), and a positive or nonneg series' value and bounds are
    floored at 0."""
    raw_scale = scale
    floored = torch.zeros_like(loc, dtype=torch.bool)
    vm = model.value_map.rows(None if series is None else series.log)  # a "series" head: log y per row
    if series is not None and series.ars is not None:  # each series' own AR where training chose one
        loc = mixed_locations(loc, series.recent, vm.log if series.log is None else series.log, series.ars)
    if series is not None:
        scale, floored = scale * series.scale.to(scale), series.floored.to(loc.device)

    def floor(v: torch.Tensor) -> torch.Tensor:
        return torch.where(floored & (v < 0), torch.zeros_like(v), v)

    value = floor(vm.to_value(loc))  # the median: loc_Y itself, or exp(loc_Y) on log y
    cols: dict[str, list] = {"value": value.tolist(), "scale": scale.tolist(), "p_num": p_num.tolist()}
    for q in levels:
        n = level_name(q)
        for prefix, calibrated in (("", True), ("raw_", False)):
            lo, hi = model.value_interval(loc, scale if calibrated else raw_scale, q, calibrated=calibrated,
                                          value_map=vm)
            cols[f"{prefix}lower_{n}"], cols[f"{prefix}upper_{n}"] = floor(lo).tolist(), floor(hi).tolist()
    n_rows = loc.numel()
    cols["series"] = series.names if series is not None else [""] * n_rows
    cols["support"] = [row_support(model, series.supports[i] if series is not None else None) for i in range(n_rows)]
    cols["transform"] = row_transforms(model, series, n_rows)
    names = prediction_columns(levels)[1:]
    return [{"row": start + i, **{k: _cell(cols[k][i]) for k in names}} for i in range(n_rows)]


def row_transforms(model, series: RowSeries | None, n_rows: int) -> list[str]:
    """The scale each row's Cauchy lives on, as `predict` says it: the adapter's, or for a "series" head each row's
    own ("log" for a positive series, "identity" for the others)."""
    if series is None or series.log is None:
        return [model.value_map.transform] * n_rows
    return ["log" if on_log else "identity" for on_log in series.log.tolist()]


def _cell(v):
    return v if isinstance(v, str) else float(v)


def row_support(model, support: str | None) -> str:
    """What a row's values may be, as `predict` says it: its series' support, else the adapter's ("positive" when
    training saw only positive values, "signed" otherwise)."""
    if support is not None:
        return support
    return "positive" if model.value_map.positive or model.value_map.log else "signed"


def predict_values(model, prompts: str | Sequence[str], tokenizer=None, levels: Sequence[float] = DEFAULT_LEVELS,
                   batch_size: int = 16, progress: Callable[[int], Any] | None = None) -> list[dict[str, Any]]:
    """The value predicted after each prompt, with its intervals; one dict per prompt, in order.

    Args:
        model: a CausalModel (value units set, i.e. trained or loaded from an adapter).
        prompts: texts ending where the number starts (see the module docstring).
        tokenizer: a Qwen tokenizer or NumberTokenizer (`CausalModel.predict_values` finds the base's
            own offline when None).
        levels: central interval levels in (0, 1).
        batch_size: prompts per forward pass.
        progress: called with the number of prompts done after each batch (a progress bar's update).

    Returns dicts with ``row`` (index in `prompts`), ``value`` (the median: loc_Y, or exp(loc_Y) for a value head
    on log y, `CausalModel.value_map`), ``scale`` (scale_Y, on the head's scale), ``p_num`` (the OvR probability that the next token is <NUM>), and per level
    ``lower_<L>`` / ``upper_<L>`` (L = 100 * level: the calibrated interval of `value_interval`,
    the raw Cauchy one when the adapter has no calibration map) and ``raw_lower_<L>`` /
    ``raw_upper_<L>`` (the raw Cauchy interval, for comparison), and what the row got (`modeling.series`):
    ``series`` (the title of the training series its text names, "" for one training never saw), ``support``
    ("positive" / "nonneg": its value and bounds never below 0; "signed") and ``transform`` (the scale of the
    head's Cauchy: "identity" or "log"; a "series" head's row: its own).
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    levels = check_levels(levels)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if model.causal_config.value_loc is None:
        raise ValueError("the adapter has no value units (value_loc / value_scale): train it first, or load a "
                         "trained adapter with CausalModel.from_pretrained")
    ntok = text_prompts_tokenizer(model, prompts, tokenizer, "predict_values")
    was_training = model.training
    model.eval()
    out: list[dict[str, Any]] = []
    try:
        for start, enc in encoded_batches(model, ntok, prompts, batch_size):
            loc, scale, p_num, fwd = predict_forward(model, enc)
            out += prediction_rows(model, loc, scale, p_num, levels, start, batch_series(model, enc, fwd))
            if progress is not None:
                progress(len(loc))
    finally:
        model.train(was_training)
    for r in out:
        if not math.isfinite(r["value"]):
            raise FloatingPointError(f"prompt {r['row']}: the predicted value is {r['value']} (not finite)")
    return out
