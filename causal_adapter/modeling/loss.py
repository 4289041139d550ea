"""Training losses (SPEC section 3): the one-vs-rest (OvR) classification loss over the whole vocabulary (its reference
formula and fused chunked implementation live in `ovr_loss`, re-exported here), the gated Cauchy regression loss,
and the total L = L_cls + lambda * L_reg, formed in one place (`total_loss`).

Shapes: N token rows (the caller flattens batch x sequence), C causal size.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config import DEFAULT_SCALE_FLOOR
from .cauchy import cauchy_nll
from .ovr_loss import (  # noqa: F401 - the documented import path of the OvR loss
    BACKEND_ENV, BACKENDS, COMPILE_ENV, DEFAULT_MEMORY_BUDGET_MB, GEMM_ENV, GEMM_PRECISIONS, RowOverride,
    _compute_dtype, chunk_sizes, fused_ovr_loss, reference_ovr_loss, resolve_backend, resolve_gemm_precision)


# --------------------------------------------------------------------------- total
def total_loss(loss_cls, loss_reg, reg_weight: float):
    """L = L_cls + lambda * L_reg (SPEC 3), lambda = `CausalAdapterConfig.reg_weight`: the one place it is
    formed, for 0-dim tensors (the model's loss) and for floats (the metrics' split-wide aggregates)."""
    return loss_cls + reg_weight * loss_reg


# --------------------------------------------------------------------------- <NUM> and regression
@torch.no_grad()
def num_probability(
    loc_U: Tensor,
    scale_Up: Tensor,
    w_num: Tensor,
    b_num: Tensor,
    c_num: Tensor,
    scale_floor: float = DEFAULT_SCALE_FLOOR,
) -> Tensor:
    """P of the <NUM> column per row, detached: loc_U, scale_Up [N, C]; w_num [C];
    b_num, c_num 0-dim. Returns [N] (float32, float64 for float64 activations)."""
    dt = _compute_dtype(loc_U, scale_Up)
    w = w_num.to(dt)
    z = loc_U.to(dt) @ w + torch.as_tensor(b_num, dtype=dt) - torch.as_tensor(c_num, dtype=dt)
    s = torch.clamp_min(scale_Up.to(dt) @ w.abs(), scale_floor)
    return torch.atan2(s, -z) / math.pi  # = 1/2 + atan(z/s)/pi, see cauchy.py


def gated_regression_loss(
    loc_Y: Tensor,
    scale_Y: Tensor,
    label_values: Tensor,
    labels: Tensor,
    num_token_id: int,
    p_num: Tensor,
    alpha: float,
    nll_offset: Tensor | None = None,
) -> Tensor:
    """L_reg = sum_i gate_i * NLL_i / max(1, sum_i m_i)   (SPEC 3), all inputs [N].

    m_i = [labels_i == num_token_id]; gate_i = m_i * (alpha + (1 - alpha) * p_num_i) with
    p_num DETACHED (else the loss could be lowered by pushing P_num down); NLL is the
    Cauchy NLL of label_values under (loc_Y, scale_Y). Rows with m = 0 contribute exactly 0
    (and zero gradient) whatever their values, even inf/NaN. `nll_offset` [N]: added to each NLL (the Jacobian of
    a value head on log y, `value_transform.ValueMap.nll_offset`: the NLL of the value itself).
    """
    m = labels.reshape(-1) == num_token_id
    loc_Y, scale_Y = loc_Y.reshape(-1), scale_Y.reshape(-1)
    dt = _compute_dtype(loc_Y, scale_Y)
    # Masked rows get harmless stand-ins before the NLL so neither value nor grad sees garbage.
    one = torch.ones((), dtype=dt, device=loc_Y.device)
    y = torch.where(m, label_values.reshape(-1).to(dt), 0 * one)
    loc = torch.where(m, loc_Y.to(dt), 0 * one)
    scale = torch.where(m, scale_Y.to(dt), one)
    p = torch.where(m, p_num.reshape(-1).detach().to(dt), 0 * one)
    gate = alpha + (1.0 - alpha) * p
    nll = cauchy_nll(y, loc, scale)
    if nll_offset is not None:
        nll = nll + torch.where(m, nll_offset.reshape(-1).to(dt), 0 * one)
    nll = torch.where(m, gate * nll, 0 * one)
    return nll.sum() / max(1, int(m.sum()))
