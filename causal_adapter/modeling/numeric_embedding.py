"""The number-aware input path (SPEC 2.1): phi(v) = sign(v) ln(1 + |v|) d, added to the token embedding at every
<NUM>."""
from __future__ import annotations

import torch
from torch import Tensor, nn


def symlog(values: Tensor) -> Tensor:
    """sign(v) ln(1 + |v|): the value's magnitude on a log scale; symlog(0) = 0."""
    return torch.sign(values) * torch.log1p(values.abs())


class NumericEmbedding(nn.Module):
    """phi(v) = symlog(v) * d with |d| = `norm` (fixed buffer unless learnable).

    The seeds take |d| = 1; CausalModel defaults to the median norm of the input embedding rows:
    the backbone's first RMSNorm divides by the norm of e + phi(v), so a phi much larger than the
    token embedding reaches the layers as sign(v) alone (docs/values.md: the measurements,
    which are mixed across corpora)."""

    def __init__(self, hidden_size: int, *, learnable: bool, std: float, generator: torch.Generator,
                 dtype: torch.dtype, device: torch.device | None = None, norm: float = 1.0):
        super().__init__()
        d = torch.randn(hidden_size, generator=generator, dtype=torch.float64) * std
        d = (d * (norm / d.norm())).to(dtype=dtype, device=device)
        if learnable:
            self.direction = nn.Parameter(d)
        else:
            self.register_buffer("direction", d)

    def forward(self, numeric_values: Tensor) -> Tensor:
        """[B, S] values -> [B, S, H] offsets (exact zeros where the value is 0).

        The log is taken in the wider of the values' and d's dtypes, so float64 values beyond the
        float32 range (up to 1.8e308) give a finite phi (|phi| <= ln(1 + 1.8e308) ~ 710)."""
        wide = torch.promote_types(numeric_values.dtype, self.direction.dtype)
        return symlog(numeric_values.to(wide)).to(self.direction.dtype).unsqueeze(-1) * self.direction
