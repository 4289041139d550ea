"""verify_initialization: seed 001's report that a fresh adapter reproduces its base model."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cauchy import ovr_probability


class InitReport(dict):
    """A dict of figures that prints as a readable report."""

    def __str__(self) -> str:
        lines = ["causal adapter initialization report"]
        for k, v in self.items():
            lines.append(f"  {k:<24} {v:.6g}" if isinstance(v, float) else f"  {k:<24} {v}")
        return "\n".join(lines)


@torch.no_grad()
def verify_initialization(causal_model: nn.Module, base_model: nn.Module, input_ids: Tensor,
                          numeric_values: Tensor | None = None, attention_mask: Tensor | None = None) -> InitReport:
    """Compare a causal model with its base model on `input_ids` [B, S].

    feature_diff   ||z - z_base|| / ||z_base||       (0 for text without numbers)
    loc_diff       ||loc_U - z|| / ||z||             (identity abduction)
    scale_U_mean / scale_U_std                        (gamma0 and 0 at init)
    logits_max_abs_diff, logits_rel_diff              loc_S vs the base logits over all V rows
    kl_softmax     KL(base || softmax(loc_S)) per position, mean
    ovr_p_mean / ovr_p_max / ovr_p_min                OvR probabilities P_k
    greedy_agreement                                  argmax loc_S == argmax base logits
    """
    was_training = causal_model.training, base_model.training
    causal_model.eval()
    base_model.eval()
    try:
        out = causal_model(input_ids, numeric_values, attention_mask=attention_mask, return_scores=True)
        base = base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    finally:
        causal_model.train(was_training[0])
        base_model.train(was_training[1])
    z, z_base = out.hidden_states.double(), base.hidden_states[-1].double()
    logits, loc_S = base.logits.double(), out.loc_S.double()
    log_p_base, log_q = F.log_softmax(logits, -1), F.log_softmax(loc_S, -1)
    kl = (log_p_base.exp() * (log_p_base - log_q)).sum(-1).mean()
    P = ovr_probability(out.loc_S, out.scale_S, causal_model.action.threshold_scores()).double()
    return InitReport(
        feature_diff=_rel(z, z_base),
        loc_diff=_rel(out.loc_U.double(), z),
        scale_U_mean=out.scale_U.double().mean().item(),
        scale_U_std=out.scale_U.double().std().item() if out.scale_U.numel() > 1 else 0.0,
        logits_max_abs_diff=(loc_S - logits).abs().max().item(),
        logits_rel_diff=_rel(loc_S, logits),
        kl_softmax=max(kl.item(), 0.0),
        ovr_p_mean=P.mean().item(),
        ovr_p_max=P.max().item(),
        ovr_p_min=P.min().item(),
        greedy_agreement=(loc_S.argmax(-1) == logits.argmax(-1)).double().mean().item(),
        vocab_rows=int(loc_S.shape[-1]),
        num_token_id=int(causal_model.num_token_id),
    )


def _rel(a: Tensor, b: Tensor) -> float:
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)
