"""The value rows of `--runner pooling` (`/v1/embeddings`, `LLM.embed`): per prompt, the value of the number that
comes next with its intervals, computed as `causal-adapter predict` computes them (`prediction.prediction_rows`:
calibration, series widths and floors included), from the hidden state z of the prompt's last position.

    row = [value, scale, p_num, lower_50, upper_50, lower_90, upper_90]     (`COLUMNS`; float32)
"""
from __future__ import annotations

from collections.abc import Callable, Set

import torch
from torch import Tensor
from vllm.model_executor.layers.pooler import Pooler
from vllm.model_executor.layers.pooler.common import PoolingParamsUpdate
from vllm.v1.pool.metadata import PoolingMetadata

from ...modeling.heads import full_precision, recent_values
from ...modeling.loss import num_probability
from ...modeling.prediction import prediction_rows
from ...modeling.series import prompt_series, series_log_rows
from .value_ids import split_value_ids

LEVELS = (0.5, 0.9)
COLUMNS = ("value", "scale", "p_num", "lower_50", "upper_50", "lower_90", "upper_90")


class ValuePooler(Pooler):
    """Pooler of the `*ForValues` classes: one row of `COLUMNS` per finished prompt (None for a prompt whose prefill
    is not finished). heads: the one-element list holding the `CausalModel`; W_cls: lm_head's weight, when called."""

    def __init__(self, heads: list, W_cls: Callable[[], Tensor]):
        super().__init__()
        self._heads, self._W_cls = heads, W_cls

    def get_supported_tasks(self) -> Set[str]:
        return {"embed"}

    def get_pooling_updates(self, task) -> PoolingParamsUpdate:
        return PoolingParamsUpdate(requires_token_ids=True)  # the prompt's numbers: the value head reads them

    def forward(self, hidden_states: Tensor, pooling_metadata: PoolingMetadata) -> list[Tensor | None]:
        cursor = pooling_metadata.get_pooling_cursor()
        z = hidden_states[cursor.last_token_indices_gpu]
        prompts = pooling_metadata.get_prompt_token_ids_cpu()
        return [self.row(z[i:i + 1], ids) if done else None
                for i, (ids, done) in enumerate(zip(prompts, cursor.get_finished_mask()))]

    @torch.no_grad()
    def row(self, z: Tensor, prompt_ids: Tensor) -> Tensor:
        """z [1, H] at a prompt's last position, its ids [S] (value ids among them) -> [len(COLUMNS)]."""
        model = self._heads[0]
        act, k = model.action, model.num_token_id
        ids, values = split_value_ids(prompt_ids.reshape(1, -1), k)
        with full_precision(z.device):  # as CausalModel.forward and prediction.predict_forward
            loc_U, scale_U = model.abduction(z)
            scale_Up = act.noisy_scale(scale_U)
            recent = None
            if act.recent_values:
                recent = recent_values(ids, values, k, act.recent_window)[:, -1].to(loc_U.device)
            log = None  # a "series" head: the row on log y when its series is positive (as forward reads it)
            if act.value_map.series:
                log = series_log_rows(ids, values, k, model.causal_config.value_series)[:, -1].to(loc_U.device)
            loc_Y, scale_Y = act.regression(loc_U, scale_Up, recent, log)
            p_num = num_probability(loc_U, scale_Up, act.num_weight(self._W_cls()), act.b_cls[k], act.num_threshold(),
                                    scale_floor=act.scale_floor)
        series = prompt_series(ids, values, None, recent, k, model.causal_config.value_series, loc_Y.double())
        series.log = None if log is None else log.cpu()
        r = prediction_rows(model, loc_Y.double(), scale_Y.double(), p_num.double(), LEVELS, 0, series)[0]
        return torch.tensor([r[c] for c in COLUMNS], dtype=torch.float32)
