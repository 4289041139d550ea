"""The model classes the plugin registers: vLLM's own Qwen2 / Qwen3 `*ForCausalLM` (its backbone, paged attention,
tensor and pipeline parallelism, quantised weights) with our input path and heads (`heads_loader.load_heads`).

    embed_input_ids: value ids -> <NUM> + value (`value_ids`); e = embed(x) + phi(v)            (`CausalModel.embed`)
    compute_logits:  z -> loc_U, scale_U' -> "softmax": loc_S = W_cls loc_U + b_cls;
                     "deterministic": (loc_S - C) / scale_S, whose argmax is that of the OvR P_k = 1/2 + atan(.)/pi
    pooler (*ForValues, `--runner pooling`): the last position's value and intervals, as `predict` (`pooling`)

The scores are computed on this rank's rows of lm_head (vocabulary-parallel under tensor parallelism) and gathered
as vLLM's LogitsProcessor gathers logits. The heads live outside the module tree (vLLM checks that every parameter
of the model came from the checkpoint; theirs come from the folder's heads file).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.sequence import IntermediateTensors

from ...modeling.heads import full_precision, linear_in_dtype
from .folder import TOKENIZER_MODE, decision_of
from .heads_loader import load_heads
from .pooling import ValuePooler
from .value_ids import split_value_ids


class CausalHeadsMixin:
    """What a vLLM `*ForCausalLM` becomes with a causal adapter (mixed in before it)."""

    #: vLLM's LoRA support (`--enable-lora`, a LoRA adapter's OUT/lora) wraps the decoder's linear layers only: never
    #: the embedding nor lm_head (Qwen3 lists both), whose weights our heads read directly (an adapter's LoRA never
    #: targets them: config.FORBIDDEN_LORA_TARGETS), nor the logits processor, which compute_logits replaces
    embedding_modules: dict[str, str] = {}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        mc = vllm_config.model_config
        if mc.tokenizer_mode != TOKENIZER_MODE:  # else numbers would reach the model as digit tokens: a wrong answer
            raise ValueError(f"a causal adapter folder is served with --tokenizer-mode {TOKENIZER_MODE} (its prompt "
                             f"numbers enter as values), got {mc.tokenizer_mode!r}")
        self.decision = decision_of(mc.hf_config)
        causal = load_heads(mc.model, mc.dtype, vllm_config.device_config.device)
        causal.backbone.set_input_embeddings(self.model.embed_tokens)  # CausalModel.embed reads vLLM's embedding
        self._heads = [causal]  # a list: not a submodule (see the module docstring)

    @property
    def causal(self):
        """The `CausalModel` whose heads run here (its backbone: meta tensors and vLLM's embedding)."""
        return self._heads[0]

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """[T] token ids (value ids among them) -> [T, H] e = embed(x) + phi(v)."""
        ids, values = split_value_ids(input_ids, self.causal.num_token_id)
        return self.causal.embed(ids.to(input_ids.device), values.to(input_ids.device))

    def forward(self, input_ids: Tensor | None, positions: Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: Tensor | None = None,
                **kwargs) -> Tensor | IntermediateTensors:
        if inputs_embeds is None and get_pp_group().is_first_rank:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.model(None, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
        """z [n, H] -> [n, V] scores whose argmax is the token `generate` picks in the folder's decision mode."""
        act, head = self.causal.action, self.lm_head
        shard = head.shard_indices
        rows = shard.num_org_elements
        ids = torch.arange(shard.org_vocab_start_index, shard.org_vocab_end_index, device=hidden_states.device)
        W = head.weight[:rows]
        with full_precision(hidden_states.device):
            loc_U, scale_U = self.causal.abduction(hidden_states)
            scale_Up = act.noisy_scale(scale_U)
            scores = act.override_num_column(linear_in_dtype(loc_U, W) + act.b_cls[ids], loc_U, ids=ids)
            if self.decision == "deterministic":
                scale_S = act.override_num_column(linear_in_dtype(scale_Up, W.abs()), scale_Up, scale=True, ids=ids)
                C = act.threshold_scores()
                scores = (scores - (C[ids] if C.dim() else C)) / scale_S.clamp_min(act.scale_floor)
        # this rank's rows, its padding at -inf, then vLLM's gather and trim of the padded vocabulary
        logits = scores.new_full((scores.shape[0], head.weight.shape[0]), -math.inf)
        logits[:, :rows] = scores
        if head.tp_size > 1:
            logits = self.logits_processor._gather_logits(logits)
        return None if logits is None else logits[..., :self.logits_processor.org_vocab_size]

    def get_top_tokens(self, hidden_states: Tensor) -> Tensor:
        return self.compute_logits(hidden_states).argmax(-1)


class CausalAdapterQwen2ForCausalLM(CausalHeadsMixin, Qwen2ForCausalLM):
    pass


class CausalAdapterQwen3ForCausalLM(CausalHeadsMixin, Qwen3ForCausalLM):
    pass


class ValuesMixin:
    """`--runner pooling`: the pooler returns each prompt's value row (`pooling.ValuePooler`)."""

    is_pooling_model = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.lm_head.tp_size > 1 and self.causal.action.num_row is None:
            raise ValueError("the value rows read W_cls's <NUM> row, which tensor parallelism splits across ranks: "
                             "serve values with tensor_parallel_size=1, or an adapter trained with train_num_row")
        self.pooler = ValuePooler(self._heads, lambda: self.lm_head.weight)


class CausalAdapterQwen2ForValues(ValuesMixin, CausalAdapterQwen2ForCausalLM):
    pass


class CausalAdapterQwen3ForValues(ValuesMixin, CausalAdapterQwen3ForCausalLM):
    pass
