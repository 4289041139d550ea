"""Value ids carry a float32 value exactly (no vLLM needed: `value_ids` is torch only)."""
from __future__ import annotations

import math

import pytest
import torch

from causal_adapter.integrations.vllm.value_ids import (MAX_VALUE_ID, VALUE_ID_BASE, is_value_id, split_value_ids,
                                                        value_id)

NUM = 151669


def test_float32_values_round_trip_exactly():
    gen = torch.Generator().manual_seed(0)
    # random bit patterns over the whole served range, both signs, and the edges of that range
    mags = torch.exp2(torch.empty(4000, dtype=torch.float64).uniform_(-63, 63.999, generator=gen))
    values = (mags * torch.where(torch.rand(4000, generator=gen) < 0.5, -1.0, 1.0)).float()
    edges = torch.tensor([2.0 ** -63, -(2.0 ** -63), 1.0, -1.0, 105.5, 66.6, 2.0 ** 64 * (1 - 2 ** -24)], dtype=torch.float32)
    values = torch.cat([values, edges])
    ids = torch.tensor([value_id(float(v)) for v in values], dtype=torch.int32)  # vLLM's token buffers are int32
    assert int(ids.min()) >= VALUE_ID_BASE and int(ids.max()) <= MAX_VALUE_ID < 2 ** 31
    plain, back = split_value_ids(ids, NUM)
    assert torch.equal(back, values) and bool((plain == NUM).all())


def test_zero_tiny_and_ordinary_ids():
    ids = torch.tensor([value_id(0.0), value_id(-0.0), value_id(1e-30), 5, NUM, VALUE_ID_BASE - 1])
    plain, values = split_value_ids(ids, NUM)
    assert plain.tolist() == [NUM, NUM, NUM, 5, NUM, VALUE_ID_BASE - 1]  # an ordinary id passes through
    assert values.tolist() == [0.0] * 6
    assert not is_value_id(NUM) and is_value_id(value_id(3.5))


@pytest.mark.parametrize("v", [2.0 ** 64, -1e30, math.inf, math.nan])
def test_a_value_beyond_the_range_is_refused(v):
    with pytest.raises(ValueError, match="cannot be served"):
        value_id(v)
