"""The checks a CausalModel makes: on the base it wraps (a supported family, full-precision heads, a
reserved row for <NUM>) and on every forward's inputs (shapes, dtypes, ids and values in range, where the
tensors sit), each failure a ValueError that names the problem."""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from ..config import BF16_MAX_SHIFT, IGNORE_INDEX, CausalAdapterConfig
from ..modeling.families import check_text_only, get_family, text_config


def check_supported(model: nn.Module) -> None:
    """Raise a ValueError naming the supported families unless `model` is one (causal_adapter.modeling.families)."""
    get_family(model)


def check_unquantized_heads(model: nn.Module) -> None:
    """A quantised base (bitsandbytes 4-bit / 8-bit: QLoRA) is fine in its decoder layers, but W_cls
    (lm_head) and the input embedding must stay full-precision [rows, H] matrices: the OvR scores use
    |W_cls| and the <NUM> row is read and trained from it. Raise a ValueError saying how to load it."""
    H = text_config(model).hidden_size
    for name, module in (("lm_head", model.get_output_embeddings()), ("input embedding", model.get_input_embeddings())):
        W = getattr(module, "weight", None)
        if not (isinstance(W, Tensor) and W.dtype.is_floating_point and W.dim() == 2 and W.shape[1] == H):
            shape = tuple(getattr(W, "shape", ()))
            what = f"{type(module).__name__} with a {getattr(W, 'dtype', None)} weight of shape {shape}"
            raise ValueError(
                f"the base model's {name} is quantised ({what}); causal_adapter needs it full precision "
                f"[rows, {H}] (W_cls is the lm_head weight). Quantise the decoder layers only: "
                "BitsAndBytesConfig(..., llm_int8_skip_modules=['lm_head']) (transformers' default when "
                "llm_int8_skip_modules is not given); embeddings are never quantised by bitsandbytes"
            )


def resolve_num_token_id(model: nn.Module, config: CausalAdapterConfig, tokenizer=None) -> int:
    """SPEC 1: config.num_token_id, else len(tokenizer), else the tokenizer found offline at
    model.name_or_path; the id must be a row of the embedding that the tokenizer does not use."""
    rows = model.get_output_embeddings().weight.shape[0]
    if config.num_token_id is not None:
        num_id = config.num_token_id
        source = "config.num_token_id"
    else:
        if tokenizer is None:
            tokenizer = offline_tokenizer(getattr(model, "name_or_path", None))
        if tokenizer is None:
            raise ValueError(
                "cannot determine the <NUM> token id: pass tokenizer=... to get_causal_model, or set "
                "CausalAdapterConfig(num_token_id=len(tokenizer)) (the first reserved embedding row)"
            )
        num_id = len(tokenizer)
        source = f"len(tokenizer)={num_id}"
        if num_id >= rows:
            raise ValueError(
                f"the model has no reserved embedding row for <NUM>: len(tokenizer)={num_id} >= "
                f"{rows} embedding rows; pass an explicit CausalAdapterConfig(num_token_id=...)"
            )
    if not 0 <= num_id < rows:
        raise ValueError(f"num_token_id={num_id} (from {source}) is outside the model's {rows} embedding rows")
    return num_id


def offline_tokenizer(name_or_path: str | None):
    if not name_or_path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except Exception:  # not a local dir / not cached: the caller raises the actionable error
        return None


def check_inputs(model, input_ids: Tensor, numeric_values: Tensor | None, labels: Tensor | None,
                 label_values: Tensor | None, attention_mask: Tensor | None = None,
                 cache: Any = None) -> None:
    """Validate `forward`'s inputs (shapes, dtypes, ids and labels in range); a ValueError names the
    problem. Also used by `generation.generate` on its prompts."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    if input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids has no positions (shape {tuple(input_ids.shape)}): an empty text encodes to no token; "
            "drop empty texts before batching"
        )
    check_placement(model)
    check_text_only(model.backbone, input_ids)
    emb_device = model.input_device
    for name, t in (("input_ids", input_ids), ("numeric_values", numeric_values), ("labels", labels),
                    ("label_values", label_values), ("attention_mask", attention_mask)):
        # labels and values may also sit with the heads (where the loss moves them)
        if isinstance(t, Tensor) and t.device != emb_device and not (name.startswith("label") and
                                                                    t.device == model.device):
            raise ValueError(f"{name} is on device {t.device} but the model's embedding is on {emb_device}: "
                             "move the inputs with .to(model.input_device)")
    for name, t in (("numeric_values", numeric_values), ("labels", labels), ("label_values", label_values)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(input_ids.shape)}")
    if (attention_mask is not None and cache is None and attention_mask.dim() == 2
            and attention_mask.shape != input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                         f"{tuple(input_ids.shape)}")
    problems = _value_problems(model, input_ids, numeric_values, labels, label_values, attention_mask)
    # one host sync for all of them (each .any() would be one); the details only on failure
    flags = torch.stack([mask.any() for mask, _ in problems]).tolist()
    for (mask, message), bad in zip(problems, flags):
        if bad:
            raise ValueError(message(_first_bad(mask)))


def _value_problems(model, input_ids: Tensor, numeric_values: Tensor | None, labels: Tensor | None,
                    label_values: Tensor | None, attention_mask: Tensor | None) -> list:
    """[(bad-position mask, index -> error message)] of `check_inputs`' value checks, in order."""
    V, num, ign = model.vocab_size, model.num_token_id, IGNORE_INDEX
    problems = [((input_ids < 0) | (input_ids >= V),
                 lambda i: f"input_ids must be in [0, {V}); got {input_ids[i].item()} at index {i}")]
    for name, t in (("numeric_values", numeric_values), ("label_values", label_values)):
        if t is not None:
            problems.append((~torch.isfinite(t), lambda i, name=name: f"{name} contains NaN or inf (first at index {i})"))
    if numeric_values is not None:
        problems.append(((numeric_values != 0) & (input_ids != num), lambda i: (
            f"numeric_values is non-zero at a position whose token is not <NUM> (id {num}), first at index {i}")))
    if labels is None:
        return problems
    problems.append(((labels != ign) & ((labels < 0) | (labels >= V)), lambda i: (
        f"labels must be -100 or in [0, {V}); got {labels[i].item()} at index {i}")))
    if attention_mask is not None and attention_mask.shape == labels.shape:
        problems.append(((labels != ign) & (attention_mask == 0), lambda i: (
            f"labels has a target ({labels[i].item()}) at index {i} where attention_mask is 0 "
            "(padding): set labels to -100 at padded positions (NumericCollator does)")))
    if label_values is not None:
        problems.append(((label_values != 0) & (labels != ign) & (labels != num), lambda i: (
            f"label_values is non-zero ({label_values[i].item()}) at index {i} whose label "
            f"{labels[i].item()} is not <NUM> (id {num}): label_values must be aligned "
            "with labels (not shifted)")))
    return problems


def check_placement(model) -> None:
    """The heads must sit on the device of W_cls and share one dtype (a partial .to() is refused)."""
    W = model.W_cls
    tensors = {"numeric_embedding": model.numeric_embedding.direction, "abduction": model.abduction.loc.weight,
               "action": model.action.b_cls}
    for name, t in tensors.items():
        if t.device != W.device:
            raise ValueError(f"the adapter's {name} head is on device {t.device} but the backbone's lm_head "
                             f"(W_cls) is on {W.device}: move the whole CausalModel with .to(device)")
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"the adapter heads have mixed dtypes {dtypes}: cast the whole CausalModel, or none")


def check_feature_precision(model, z: Tensor) -> None:
    """Warn (once per model) when a value head fitted on float32 features runs on 16-bit ones: `z` [B, S, H]
    16-bit (a bf16 / fp16 base) or computed under 16-bit autocast, while the fit recorded float32 features and
    a bf16 shift above `BF16_MAX_SHIFT` value units (config.value_fit_dtype / value_bf16_shift). Such a head
    reads loc_U differences below bf16's resolution, so its values move by about that shift (an H100 under
    bf16 autocast: test MAE 40x, docs/mixed_precision.md)."""
    cfg = model.causal_config
    if (getattr(model, "_precision_warned", False) or cfg.value_fit_dtype != "float32"
            or not (cfg.value_bf16_shift or 0.0) > BF16_MAX_SHIFT * (cfg.value_scale or 1.0)):
        return
    dev = z.device.type
    half = (torch.bfloat16, torch.float16)
    autocast = torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) in half
    if z.dtype not in half and not autocast:
        return
    model._precision_warned = True
    where = f"autocast to {torch.get_autocast_dtype(dev)}" if autocast else f"a {z.dtype} base"
    warnings.warn(f"this adapter's value head was fitted on float32 features, and it now runs under {where}: "
                  f"rounding loc_U to 16 bits moves its values by up to {cfg.value_bf16_shift:.4g} "
                  f"(value_scale {cfg.value_scale:.4g}). For values, run the base in float32 without autocast, "
                  "or train with the base in bf16 (the fit then sees the features it will run on; "
                  "docs/mixed_precision.md)", UserWarning, stacklevel=3)


def _first_bad(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])
