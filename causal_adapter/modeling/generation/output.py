"""What generation returns: `GenerationOutput`, built from the rows the step loop wrote (`rows_output`), with each
generated number's intervals (`row_numbers`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..intervals import interval
from .record import Row
from .stream import format_value, decode_text


@dataclass
class GenerationOutput:
    """Result of `generate`. B batch, S prompt length (padded), T generated steps.

    sequences: [B, S+T] prompt + generated ids (pad after a row finished).
    numeric_values: [B, S+T] values aligned with `sequences` (non-zero only at <NUM>).
    attention_mask: [B, S+T] prompt mask, 1 for generated tokens, 0 for the padding after a
        row finished (ready for a continuation).
    new_tokens, new_values: [B, T] the generated part.
    lengths: [B] generated tokens per row (eos / the token completing a stop string included).
    finished: [B] bool, True when the row stopped on eos or a stop string.
    token_probs: [B, T] OvR probability P_k of each chosen token (0 after the row finished).
    numbers: per row, one dict per generated <NUM>: position (index in new_tokens), index (in
        sequences), value (what was emitted and fed back: rounded to `config.value_decimals`
        when the adapter has them), exact (the value before rounding), text (as rendered), loc /
        scale (loc_Y, scale_Y of that step), p_num (P(<NUM>): the OvR probability of <NUM> at that step, as
        `predict_values`' p_num), interval_50 / interval_90 (the central intervals the adapter
        reports: calibrated when it has a calibration map, as `CausalModel.value_interval`) and
        raw_interval_50 / raw_interval_90 (the raw Cauchy ones).
    texts: decoded generated text per row (numbers rendered), when a tokenizer was available.
    eps: [B, T, C] the uniforms of causal mode (with return_eps=True); with
        shared_individual=True every step of a row holds the same eps.
    stop_reasons: per row, None, or why it ended before eos, a stop string or max_new_tokens: a sentence when its
        hidden state or the value of the number it chose was not finite (the row ends before that step; the
        other rows go on).
    """

    sequences: Tensor
    numeric_values: Tensor
    attention_mask: Tensor
    new_tokens: Tensor
    new_values: Tensor
    lengths: Tensor
    finished: Tensor
    token_probs: Tensor
    numbers: list[list[dict[str, Any]]] = field(default_factory=list)
    texts: list[str] | None = None
    eps: Tensor | None = None
    mode: str = "deterministic"
    stop_reasons: list[str | None] = field(default_factory=list)

    def row(self, b: int) -> "GenerationOutput":
        """Row `b` alone, as generating its prompt by itself returns it: the prompt's left padding and the
        steps after the row finished cut off (`numbers[..]["index"]` counted in the unpadded sequence)."""
        S = self.sequences.shape[1] - self.new_tokens.shape[1]
        pad = S - int(self.attention_mask[b, :S].sum())
        n = int(self.lengths[b])
        numbers = [{**d, "index": d["index"] - pad} for d in self.numbers[b]] if self.numbers else []
        return GenerationOutput(
            sequences=self.sequences[b:b + 1, pad:S + n], numeric_values=self.numeric_values[b:b + 1, pad:S + n],
            attention_mask=self.attention_mask[b:b + 1, pad:S + n], new_tokens=self.new_tokens[b:b + 1, :n],
            new_values=self.new_values[b:b + 1, :n], lengths=self.lengths[b:b + 1], finished=self.finished[b:b + 1],
            token_probs=self.token_probs[b:b + 1, :n], numbers=[numbers],
            texts=None if self.texts is None else [self.texts[b]],
            eps=None if self.eps is None else self.eps[b:b + 1, :n], mode=self.mode,
            stop_reasons=self.stop_reasons[b:b + 1])


def row_numbers(row: Row, prompt_length: int, calibration: dict | None) -> list[dict[str, Any]]:
    """One dict per <NUM> the row wrote (`GenerationOutput.numbers`); interval_50 / interval_90 are the adapter's
    reported intervals (calibrated with `calibration`, as `CausalModel.value_interval`), raw_interval_* the raw
    Cauchy ones."""
    num_id = row.group.settings.num_id
    at = [t for t, tok in enumerate(row.tokens) if tok == num_id]
    out = []
    for t in at:
        v = row.fed_values[t]
        out.append({"position": t, "index": prompt_length + t, "value": v,
                    "text": format_value(v) if math.isfinite(v) else str(v), "loc": row.loc_Y[t],
                    "scale": row.scale_Y[t],
                    "exact": row.exact[t], "p_num": float(row.probs[t])})
    if out:  # every number's intervals at once (float64, elementwise: what one number alone gives)
        loc = torch.tensor([d["loc"] for d in out], dtype=torch.float64)
        scale = torch.tensor([d["scale"] for d in out], dtype=torch.float64)
        for q in (0.5, 0.9):
            for prefix, cal in (("", calibration), ("raw_", None)):  # calibrated: in its series' width
                lo, hi = interval(loc, scale * row.series_scale if cal else scale, q, cal,
                                  row.group.settings.value_map.row(row.floored, row.log))  # `Row.floored`
                for d, a, b in zip(out, lo.tolist(), hi.tolist()):
                    d[f"{prefix}interval_{round(100 * q)}"] = (a, b)
    return out


def rows_output(rows: Sequence[Row], input_ids: Tensor, numeric_values: Tensor, attention_mask: Tensor, *,
                calibration_of: Callable[[Row], dict | None], ntok=None) -> GenerationOutput:
    """The rows (prompts `input_ids` / `numeric_values` / `attention_mask` [B, S], left padded) as one batch: the
    generated part padded to the longest row with its pad id / value 0."""
    g = rows[0].group
    s, vdtype, device = g.settings, g.vdtype, input_ids.device
    steps = max(len(r.tokens) for r in rows)

    def padded(name: str, fill, dtype) -> Tensor:
        return torch.tensor([getattr(r, name) + [fill(r)] * (steps - len(r.tokens)) for r in rows], dtype=dtype,
                            device=device).reshape(len(rows), steps)

    new_tokens = padded("tokens", lambda r: r.group.settings.pad_id, torch.long)
    new_values = padded("fed_values", lambda r: 0.0, vdtype)
    lengths = torch.tensor([len(r.tokens) for r in rows], dtype=torch.long, device=device)
    gen_mask = torch.arange(steps, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    S = input_ids.shape[1]
    texts = None
    if ntok is not None:
        texts = [decode_text(ntok, r.tokens, r.fed_values, int(input_ids[b, -1]), float(numeric_values[b, -1]))
                 for b, r in enumerate(rows)]
    eps = None
    if s.opts.return_eps:
        eps = torch.zeros(len(rows), steps, s.C, dtype=s.hdtype, device=device)
        for b, r in enumerate(rows):
            if r.eps:
                eps[b, :len(r.eps)] = torch.stack(r.eps).to(device)
    return GenerationOutput(
        sequences=torch.cat([input_ids, new_tokens], 1), numeric_values=torch.cat([numeric_values.to(vdtype), new_values], 1),
        attention_mask=torch.cat([attention_mask, gen_mask.long()], 1), new_tokens=new_tokens, new_values=new_values,
        lengths=lengths, finished=torch.tensor([r.finished for r in rows], dtype=torch.bool, device=device),
        token_probs=padded("probs", lambda r: 0.0, s.hdtype),
        numbers=[row_numbers(r, S, calibration_of(r)) for r in rows], texts=texts, eps=eps, mode=s.opts.mode,
        stop_reasons=[r.stop_reason for r in rows])


def row_output(row: Row, *, calibration: dict | None, ntok=None) -> GenerationOutput:
    """One row alone (`GenerationOutput.row` of a batch: its prompt without padding)."""
    ids = torch.tensor([row.ids], dtype=torch.long, device=row.group.settings.device)
    values = torch.tensor([row.values], dtype=row.group.values_dtype, device=ids.device)
    return rows_output([row], ids, values, torch.ones_like(ids), calibration_of=lambda r: calibration, ntok=ntok)
