"""Renamed config fields: adapters saved with the old names still load (a FutureWarning), into the new names."""
import json
import warnings

import pytest
import torch

from causal_adapter import CausalAdapterConfig
from causal_adapter.config import RENAMED_FIELDS

from test_train import small_model


def test_the_old_names_load_into_the_new_ones_with_a_future_warning():
    new = CausalAdapterConfig(recent_values=4, value_row_units="last", value_width_power=0.5,
                              value_row_net=2, value_row_net_hidden=16).to_dict()
    assert not set(RENAMED_FIELDS) & set(new)
    old = {(next((o for o, n in RENAMED_FIELDS.items() if n == k), k)): v for k, v in new.items()}
    assert {"value_row_width", "value_row_net_width"} <= set(old) and "value_width_power" not in old
    with pytest.warns(FutureWarning, match="value_row_width.*value_width_power"):
        loaded = CausalAdapterConfig.from_json(json.dumps(old))
    assert loaded == CausalAdapterConfig.from_dict(new)
    assert loaded.value_width_power == 0.5 and loaded.value_row_net_hidden == 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names load without a warning
        assert CausalAdapterConfig.from_dict(loaded.to_dict()) == loaded
    with pytest.raises(ValueError, match="both"):
        CausalAdapterConfig.from_dict({**new, "value_row_width": 0.5})


def test_an_adapter_saved_with_the_old_names_loads_and_predicts_the_same(tmp_path):
    from causal_adapter.model import CausalModel
    from causal_adapter.saving.assets import build_tiny_qwen

    model = small_model(recent_values=4, value_loc=10.0, value_scale=2.0, value_row_units="last",
                        value_width_power=0.5, value_row_net=2, value_row_net_hidden=8)
    with torch.no_grad():
        model.action.w_recent.copy_(torch.tensor([0.5, 0.2, 0.1, 0.0]))
    model.save_pretrained(tmp_path / "old")
    config_file = tmp_path / "old" / "causal_adapter_config.json"
    text = config_file.read_text()
    assert '"value_width_power": 0.5' in text and '"value_row_net_hidden": 8' in text
    # as an adapter saved before the rename
    config_file.write_text(text.replace('"value_width_power"', '"value_row_width"')
                           .replace('"value_row_net_hidden"', '"value_row_net_width"'))
    with pytest.warns(FutureWarning, match="value_row_net_width"):
        loaded = CausalModel.from_pretrained(build_tiny_qwen("qwen2", hidden_size=32, num_layers=1, vocab_size=320),
                                              tmp_path / "old")
    assert loaded.causal_config.value_width_power == 0.5 and loaded.causal_config.value_row_net_hidden == 8
    ids = torch.tensor([[11, model.num_token_id, 12, model.num_token_id, 13, model.num_token_id, 14]])
    vals = torch.tensor([[0.0, 1999.0, 0.0, 3.5, 0.0, 2000.0, 0.0]])
    with torch.no_grad():
        a, b = model(ids, vals), loaded(ids, vals)
    assert torch.equal(a.loc_Y, b.loc_Y) and torch.equal(a.scale_Y, b.scale_Y)


def test_the_heads_units_are_head_loc_and_head_scale_and_the_old_names_warn():
    model = small_model(recent_values=4, value_loc=10.0, value_scale=2.0)
    act = model.action
    assert (act.head_loc, act.head_scale) == (10.0, 2.0)
    with pytest.warns(FutureWarning, match="head_loc"):
        assert act.value_loc == 10.0
    with pytest.warns(FutureWarning, match="head_scale"):
        assert act.value_scale == 2.0
    with pytest.warns(FutureWarning, match="set_head_units"):
        act.set_value_units(3.0, 4.0)
    assert (act.head_loc, act.head_scale) == (3.0, 4.0)
