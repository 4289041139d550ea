"""The batch of a training or evaluation step: `NumericCollator` pads the four features of number-aware rows
(``input_ids``, ``numeric_values``, ``labels``, ``label_values``) and builds ``attention_mask``, on either side, with
the conventions of `data.pipeline` (pad id, 0.0, -100, 0.0); `batch_length` and `padded_features` are shared with
the packed rows' collator (`data.packing`)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..config import IGNORE_INDEX
from ..numbers import to_list

FEATURE_COLUMNS = ("input_ids", "numeric_values", "labels", "label_values")


def batch_length(lengths: Sequence[int], pad_to_multiple_of: int | None = None, minimum: int = 0) -> int:
    """The padded length of a batch: its longest row (at least `minimum`), rounded up to a multiple when asked."""
    length = max(minimum, max(lengths))
    return -(-length // pad_to_multiple_of) * pad_to_multiple_of if pad_to_multiple_of else length


def padded_features(b: int, length: int, pad_token_id: int, labels: bool = True) -> dict:
    """[b, length] tensors of padding: input_ids = pad, numeric_values 0.0 (and labels -100, label_values 0.0)."""
    import torch

    out = {"input_ids": torch.full((b, length), pad_token_id, dtype=torch.long),
           "numeric_values": torch.zeros((b, length), dtype=torch.float32)}
    if labels:
        out["labels"] = torch.full((b, length), IGNORE_INDEX, dtype=torch.long)
        out["label_values"] = torch.zeros((b, length), dtype=torch.float32)
    return out


class NumericCollator:
    """Pads a list of feature dicts into tensors (SPEC section 1 padding rules).

    ``NumericCollator(pad_token_id, padding_side="right", max_length=None)``; ``pad_token_id``
    may also be a `NumberTokenizer` (its ``pad_token_id`` is used). Each feature needs
    ``input_ids``; ``numeric_values`` (default 0.0), ``labels`` and ``label_values`` (default:
    ``numeric_values`` where labels != -100) are optional; ``attention_mask`` is built.
    Sequences longer than ``max_length`` keep their first ``max_length`` positions.
    Other keys holding plain numbers (``target``, ``previous``) are stacked into 1-D tensors
    (int64 / float64 / bool); other keys (strings, lists, ...) are dropped.
    Returns ``input_ids``/``attention_mask``/``labels`` (long), ``numeric_values``/``label_values``
    (float32) of shape [B, S].
    """

    def __init__(self, pad_token_id, padding_side: str = "right", max_length: int | None = None,
                 pad_to_multiple_of: int | None = None):
        if hasattr(pad_token_id, "pad_token_id"):
            pad_token_id = pad_token_id.pad_token_id
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a non-negative int, got {pad_token_id!r}")
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}")
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of

    def __repr__(self) -> str:
        return (f"NumericCollator(pad_token_id={self.pad_token_id}, padding_side={self.padding_side!r}, "
                f"max_length={self.max_length})")

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict:
        import torch

        if not features:
            raise ValueError("NumericCollator got an empty batch")
        rows = []
        has_labels = "labels" in features[0]
        for i, f in enumerate(features):
            if "input_ids" not in f:
                raise ValueError(f"feature {i} has no 'input_ids' (keys: {sorted(f)})")
            if ("labels" in f) != has_labels:
                raise ValueError(f"feature {i}: 'labels' present in some features of the batch but not all")
            ids = to_list(f["input_ids"])
            n = len(ids)
            vals = to_list(f.get("numeric_values")) if f.get("numeric_values") is not None else [0.0] * n
            mask = to_list(f.get("attention_mask")) if f.get("attention_mask") is not None else [1] * n
            labels = to_list(f["labels"]) if has_labels else None
            lvals = to_list(f.get("label_values")) if f.get("label_values") is not None else None
            for name, seq in (("numeric_values", vals), ("attention_mask", mask), ("labels", labels),
                              ("label_values", lvals)):
                if seq is not None and len(seq) != n:
                    raise ValueError(f"feature {i}: {name} has length {len(seq)} but input_ids has {n}")
            if has_labels and lvals is None:
                lvals = [v if l != IGNORE_INDEX else 0.0 for v, l in zip(vals, labels)]
            m = self.max_length
            if m is not None and n > m:
                ids, vals, mask = ids[:m], vals[:m], mask[:m]
                if has_labels:
                    labels, lvals = labels[:m], lvals[:m]
            rows.append((ids, vals, mask, labels, lvals))

        length = batch_length([len(r[0]) for r in rows], self.pad_to_multiple_of)
        out = padded_features(len(rows), length, self.pad_token_id, labels=has_labels)
        out["attention_mask"] = torch.zeros((len(rows), length), dtype=torch.long)
        for i, (ids, vals, mask, labels, lvals) in enumerate(rows):
            k = len(ids)
            if k == 0:
                continue
            sl = slice(0, k) if self.padding_side == "right" else slice(length - k, length)
            out["input_ids"][i, sl] = torch.tensor(ids, dtype=torch.long)
            out["numeric_values"][i, sl] = torch.tensor(vals, dtype=torch.float32)
            out["attention_mask"][i, sl] = torch.tensor(mask, dtype=torch.long)
            if has_labels:
                out["labels"][i, sl] = torch.tensor(labels, dtype=torch.long)
                out["label_values"][i, sl] = torch.tensor(lvals, dtype=torch.float32)
        # plain numeric extras (target, previous, ...) stacked; anything else dropped
        skip = set(FEATURE_COLUMNS) | {"attention_mask"}
        for key in features[0]:
            if key in skip:
                continue
            vals_k = [f.get(key) for f in features]
            if all(isinstance(v, bool) for v in vals_k):
                out[key] = torch.tensor(vals_k, dtype=torch.bool)
            elif all(isinstance(v, int) and not isinstance(v, bool) for v in vals_k):
                out[key] = torch.tensor(vals_k, dtype=torch.long)
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals_k):
                out[key] = torch.tensor(vals_k, dtype=torch.float64)  # exact (not a model input)
        return out
