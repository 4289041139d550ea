"""Value ids: a prompt number as ONE token id that carries its value, so vLLM's engine (which moves only token ids
from the tokenizer to the model) hands the model every number's value, as our forward reads it.

    id = VALUE_ID_BASE + code(float32(v))      VALUE_ID_BASE = 2^18 > every Qwen vocabulary (151,936; 248,320)
    code = 0 for |v| < 2^-63; else 1 + (e - 64) 2^23 + m (+ 2^30 when v < 0), e, m: float32's exponent, mantissa

Every float32 with 2^-63 <= |v| < 2^64 round-trips exactly (`pad_batch` holds prompt values in float32, so the model
reads the same value `predict` reads); the largest id, 2,139,357,184, fits vLLM's int32 token buffers. A value id
decodes to the <NUM> id and its value. torch only: the export command and the tests import it without vLLM.
"""
from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

VALUE_ID_BASE = 1 << 18
_SIGN, _EXP_LO, _EXP_HI = 1 << 30, 64, 190  # biased float32 exponents kept: [2^-63, 2^64)
MAX_VALUE_ID = VALUE_ID_BASE + _SIGN + (_EXP_HI - _EXP_LO + 1) * (1 << 23)


def value_id(v: float) -> int:
    """The id of a number of value `v`; a ValueError for |v| >= 2^64 or a value that is not finite."""
    if not math.isfinite(v):
        raise ValueError(f"a number of value {v} cannot be served: not finite")
    bits = struct.unpack("<I", struct.pack("<f", v))[0] if abs(v) < 3.4e38 else 0xFF << 23
    e, m = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if e > _EXP_HI:
        raise ValueError(f"a number of value {v:g} cannot be served through vLLM: |value| must be below 2^64 "
                         "(value ids carry float32 values in [2^-63, 2^64))")
    if e < _EXP_LO:  # |v| < 2^-63: read as 0 (phi(v) ~ v: below float32's resolution next to the token embedding)
        return VALUE_ID_BASE
    return VALUE_ID_BASE + (_SIGN if bits >> 31 else 0) + 1 + ((e - _EXP_LO) << 23) + m


def value_of_id(token_id: int) -> float:
    """The value a value id carries (the inverse of `value_id` on float32 values)."""
    return float(split_value_ids(torch.tensor([token_id]), 0)[1][0])


def is_value_id(token_id: int) -> bool:
    return VALUE_ID_BASE <= token_id <= MAX_VALUE_ID


def split_value_ids(ids: Tensor, num_token_id: int) -> tuple[Tensor, Tensor]:
    """ids [...] (any integer dtype) -> (ids with every value id replaced by `num_token_id`, values [...] float32, 0
    elsewhere)."""
    ids = ids.long()
    is_value = ids >= VALUE_ID_BASE
    code = torch.where(is_value, ids - VALUE_ID_BASE, torch.zeros_like(ids))
    negative = code >= _SIGN
    t = torch.where(negative, code - _SIGN, code) - 1  # -1 where the value is 0
    bits = ((t >> 23) + _EXP_LO) << 23 | (t & 0x7FFFFF)
    bits = torch.where(negative, bits - (1 << 31), bits)  # the sign bit, as an int32 holds it
    values = bits.to(torch.int32).view(torch.float32)
    values = torch.where(is_value & (t >= 0), values, torch.zeros_like(values))
    return torch.where(is_value, torch.full_like(ids, num_token_id), ids), values


def join_value_ids(ids: list[int], values: list[float], num_token_id: int) -> list[int]:
    """A NumberTokenizer encoding (ids with <NUM>, values) -> ids with each <NUM> a value id."""
    return [value_id(v) if i == num_token_id else i for i, v in zip(ids, values)]
