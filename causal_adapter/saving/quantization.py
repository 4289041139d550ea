"""A bitsandbytes-quantised base (QLoRA) made ready to train, whatever the CPU.

bitsandbytes >= 0.50 repacks a 4-bit weight into an inference-only layout on a CPU with AVX512-BF16
(`packing_format_for_cpu`) at the first forward that runs in eval mode on inputs that need no grad.
A training run makes such forwards itself (the value head's warm start, mid-run evaluations), and
every training forward after the repacking fails in bitsandbytes' autograd function. So for training
the packing is undone where it already happened and switched off for the layers: the same weights,
the layout that trains, on every CPU.
"""
from __future__ import annotations

from torch import nn


def prepare_quantized_for_training(model: nn.Module) -> int:
    """Undo bitsandbytes' CPU inference packing of every 4-bit layer in `model` and keep it from
    happening again. Returns the number of layers whose weight was unpacked. A no-op on a model
    without 4-bit layers, or with a bitsandbytes that has no such packing."""
    unpacked = 0
    for module in model.modules():
        if not hasattr(module, "support_avx512bf16_for_cpu"):
            continue  # not a bitsandbytes Linear4bit (or a release without the CPU packing)
        module.support_avx512bf16_for_cpu = False
        weight = module.weight
        if getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
            module.quant_state = weight.quant_state
            unpacked += 1
    return unpacked
