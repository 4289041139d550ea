"""Every Qwen family (SPEC 6): dense, MoE, hybrid linear attention (Qwen3-Next, Qwen3.5) and the
language model of a Qwen3.5 *ForConditionalGeneration, each a tiny random model of the real
transformers class. Init equivalence, cache vs recomputation in every mode, frozen / LoRA
training, save / load, refusals. MoE models in float64 run transformers' eager experts loop."""
import pytest
import torch

from causal_adapter import CausalAdapterConfig, CausalModel, LoraSettings, get_causal_model
from causal_adapter.saving.assets import QWEN3_5_VOCAB_SIZE, build_tiny_qwen
from causal_adapter._compat import cache_keyword
from causal_adapter.config import DEFAULT_LORA_TARGETS
from causal_adapter.modeling.families import EXPERT_LORA_PARAMETERS, FAMILIES, family_name
from test_artifacts import optimise
from test_generation import NUM_SMALL, perturb, reference_generate, small_prompts

# (arch, vision): every family, and the two vision-language checkpoints
CASES = [("qwen2", False), ("qwen3", False), ("qwen2_moe", False), ("qwen3_moe", False), ("qwen3_next", False),
         ("qwen3_5", False), ("qwen3_5_moe", False), ("qwen3_5", True), ("qwen3_5_moe", True)]
HYBRID = [c for c in CASES if FAMILIES[c[0]].hybrid]
IDS = [f"{a}{'-vl' if v else ''}" for a, v in CASES]
VOCAB = 320  # small vocabulary (tests whose subject is not the vocabulary); <NUM> = row 300


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread mostly waits
    yield
    torch.set_num_threads(n)


def tiny(arch, vision=False, dtype=torch.float64, seed=0, vocab_size=VOCAB, std=0.1, **kw):
    """A tiny random model of the family with its layers stirred (std 0.02 weights barely use them)."""
    base = build_tiny_qwen(arch, hidden_size=32, num_layers=2, vocab_size=vocab_size, dtype=dtype, seed=seed,
                           vision=vision, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in base.get_decoder().layers.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std)
    return base


def wrap(base, **cfg):
    cfg.setdefault("num_token_id", NUM_SMALL)
    return get_causal_model(base, CausalAdapterConfig(**cfg))


def left_padded(vocab=290, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


# --------------------------------------------------------------------------- init equivalence
@pytest.mark.parametrize("arch,vision", CASES, ids=IDS)
def test_init_equivalence_every_family(arch, vision):
    base = tiny(arch, vision)
    model = wrap(base)
    assert family_name(base) == arch and model.decoder is base.get_decoder()
    ids, mask = left_padded()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, return_scores=True)
        ref = base(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    live = mask.bool()
    assert (out.loc_S - ref.logits)[live].abs().max().item() <= 1e-10
    assert torch.equal(out.hidden_states, ref.hidden_states[-1])  # text without numbers: bit for bit
    # softmax greedy generation = transformers' greedy generation, left-padded batch, token for token
    T = 6
    gen = model.generate(input_ids=ids, attention_mask=mask, mode="softmax", max_new_tokens=T, eos_token_id=[])
    expected = base.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=T, eos_token_id=None,
                             pad_token_id=0)
    assert torch.equal(gen.sequences, expected)
    assert len(set(expected[:, -T:].flatten().tolist())) > 3  # a real continuation, not one repeated token


@pytest.mark.parametrize("vision", [False, True], ids=["text", "vl"])
def test_qwen3_5_real_vocabulary(vision):
    """248,320 rows, <NUM> on a reserved row given explicitly (no Qwen3.5 tokenizer offline)."""
    base = build_tiny_qwen("qwen3_5", hidden_size=32, num_layers=2, dtype=torch.float64, vision=vision)
    assert base.get_output_embeddings().weight.shape[0] == QWEN3_5_VOCAB_SIZE
    num = QWEN3_5_VOCAB_SIZE - 20
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=num))
    assert model.vocab_size == QWEN3_5_VOCAB_SIZE and model.num_token_id == num
    ids, mask = left_padded(vocab=200_000)
    with torch.no_grad():
        loc_S = model(ids, attention_mask=mask, return_scores=True).loc_S
        logits = base(input_ids=ids, attention_mask=mask).logits
    assert loc_S.shape[-1] == QWEN3_5_VOCAB_SIZE
    assert (loc_S - logits)[mask.bool()].abs().max().item() <= 1e-10
    ids[0, 3] = num
    vals = torch.zeros(ids.shape, dtype=torch.float64)
    vals[0, 3] = 2.5
    out = model.generate(input_ids=ids, numeric_values=vals, attention_mask=mask, max_new_tokens=3)
    assert out.new_tokens.shape == (3, 3)
    with pytest.raises(ValueError, match="cannot determine the <NUM> token id"):
        get_causal_model(base)
    if vision:  # text in, numbers out: images are refused, clearly
        ids[1, 4] = base.config.image_token_id
        with pytest.raises(ValueError, match="image_token_id=248056.*text only"):
            model(ids, attention_mask=mask)
        with pytest.raises(ValueError, match=r"\['pixel_values', 'image_grid_thw'\].*text only"):
            model.generate({"input_ids": ids, "pixel_values": torch.zeros(4, 8), "image_grid_thw": torch.ones(1, 3)})


# --------------------------------------------------------------------------- cache == recomputation
MODES = [("softmax", {}), ("softmax", dict(top_k=20, temperature=0.7, seed=3)), ("deterministic", {}),
         ("causal", dict(seed=11)), ("causal", dict(seed=12, shared_individual=True))]


@pytest.mark.parametrize("arch,vision", CASES[2:], ids=IDS[2:])
def test_cached_generation_equals_recomputation_every_mode(arch, vision):
    model = perturb(wrap(tiny(arch, vision), gamma0=1.0), num_bias=3.0)
    ids, vals, mask = small_prompts()
    T, seen_num = 6, 0
    steps = []
    hook = model.decoder.register_forward_pre_hook(
        lambda m, a, kw: steps.append((kw["inputs_embeds"].shape[1], kw.get(cache_keyword(m)))), with_kwargs=True)
    for mode, kw in MODES:
        steps.clear()
        out = model.generate(input_ids=ids, numeric_values=vals, attention_mask=mask, mode=mode, max_new_tokens=T,
                             eos_token_id=[], **kw)
        # O(1) per token: the prompt once, then only the new token, on the cache the backbone created
        assert [n for n, _ in steps] == [ids.shape[1]] + [1] * (T - 1)
        assert steps[0][1] is None and all(c is steps[1][1] for _, c in steps[1:])
        cache = steps[1][1]
        ref_ids, ref_vals = reference_generate(model, ids, vals, mask, mode, T, seed=kw.get("seed"),
                                               shared=kw.get("shared_individual", False), top_k=kw.get("top_k"),
                                               temperature=kw.get("temperature"))
        assert torch.equal(out.new_tokens, ref_ids), mode
        # the gated delta rule runs in float32 even in a float64 model, and the cached step (recurrent form)
        # and the full forward (chunked form) round differently: values agree to float32 precision
        torch.testing.assert_close(out.new_values, ref_vals, rtol=1e-6, atol=1e-5)
        seen_num += int((out.new_tokens == NUM_SMALL).sum())
    hook.remove()
    assert seen_num >= 2  # generated numbers were fed back
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert ("LinearAttentionLayer" in kinds) == FAMILIES[arch].hybrid  # conv / recurrent state of the hybrids


# --------------------------------------------------------------------------- training modes
@pytest.mark.parametrize("arch,vision", CASES, ids=IDS)
def test_frozen_training_runs_without_graph(arch, vision):
    model = wrap(tiny(arch, vision, dtype=torch.float32))
    assert not model.backbone_needs_grad()
    seen = []
    handle = model.decoder.norm.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad))
    ids, mask = left_padded()
    labels = ids.masked_fill(mask == 0, -100)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    handle.remove()
    assert seen == [False]
    assert all(p.grad is None for p in model.backbone.parameters())
    assert model.action.b_cls.grad.abs().sum() > 0


EXPECTED_TARGETS = {
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],  # shared expert
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],  # every MLP is MoE: experts only by opt-in
    # peft turns gate/up/down_proj of qwen3_next into its fused experts: the shared expert is out of reach
    "qwen3_next": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"],
    "qwen3_5": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
}
EXPECTED_TARGETS["qwen3"] = EXPECTED_TARGETS["qwen2"]
EXPECTED_TARGETS["qwen3_5_moe"] = EXPECTED_TARGETS["qwen3_5"]


def train_steps(model, steps=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 290, (2, 6), generator=g)
    ids[:, 2] = NUM_SMALL
    vals = torch.zeros(2, 6)
    vals[:, 2] = torch.tensor([3.5, -1.0])
    optimise(model, ids, vals, steps)
    return ids, vals


@pytest.mark.parametrize("arch,vision", CASES, ids=IDS)
def test_lora_defaults_train_only_adapter_tensors(arch, vision):
    settings = LoraSettings(r=2)
    model = wrap(tiny(arch, vision, dtype=torch.float32), lora=settings)
    assert model.causal_config.lora.target_modules == EXPECTED_TARGETS[arch]
    assert settings.target_modules == list(DEFAULT_LORA_TARGETS)  # the caller's settings are not modified
    lora = {n for n, p in model.backbone.named_parameters() if p.requires_grad}
    targeted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora}
    assert targeted == set(EXPECTED_TARGETS[arch])
    assert all("lora_" in n and "visual" not in n and "embed" not in n and "lm_head" not in n for n in lora)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_steps(model)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n or not n.startswith("backbone.") for n in changed)
    assert any("lora_B" in n for n in changed)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_expert_lora_through_peft_target_parameters(arch, tmp_path):
    settings = LoraSettings(r=2, target_parameters=list(EXPERT_LORA_PARAMETERS))
    model = wrap(tiny(arch, dtype=torch.float32), lora=settings)
    expert_lora = [n for n, p in model.backbone.named_parameters() if p.requires_grad and "experts" in n]
    assert len(expert_lora) == 2 * 2 * 2  # 2 layers x (gate_up_proj, down_proj) x (A, B)
    ids, mask = left_padded()
    with torch.no_grad():  # B = 0 at init: still the base model
        torch.testing.assert_close(model(ids, attention_mask=mask, return_scores=True).loc_S,
                                   model.backbone(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, vals = train_steps(model)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any("experts" in n and "lora_B" in n for n in changed)
    assert all("lora_" in n or not n.startswith("backbone.") for n in changed)
    model.save_pretrained(tmp_path / "a")
    loaded = CausalModel.from_pretrained(tiny(arch, dtype=torch.float32), tmp_path / "a")
    with torch.no_grad():
        a, b = model(ids, vals, return_scores=True), loaded(ids, vals, return_scores=True)
    assert torch.equal(a.loc_S, b.loc_S) and torch.equal(a.loc_Y, b.loc_Y)


def test_lora_names_that_peft_turns_into_experts_are_refused():
    with pytest.raises(ValueError, match=r"\['gate_proj'\] on qwen3_next: peft maps these names to the fused MoE"):
        wrap(tiny("qwen3_next", dtype=torch.float32), lora=LoraSettings(r=2, target_modules=["q_proj", "gate_proj"]))
    model = wrap(tiny("qwen2_moe", dtype=torch.float32), lora=LoraSettings(r=2, target_modules=["gate_proj"]))
    assert {n.split(".lora_")[0] for n, p in model.backbone.named_parameters() if p.requires_grad} == {
        f"model.layers.{i}.mlp.shared_expert.gate_proj" for i in range(2)}  # qwen2_moe: peft keeps the name


# --------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("arch,vision", CASES[2:], ids=IDS[2:])
def test_save_load_same_family_and_refuse_another(arch, vision, tmp_path):
    model = wrap(tiny(arch, vision, dtype=torch.float32), lora=LoraSettings(r=2), learnable_direction=True)
    ids, vals = train_steps(model, steps=3)
    model.save_pretrained(tmp_path / "a")
    loaded = CausalModel.from_pretrained(tiny(arch, vision, dtype=torch.float32), tmp_path / "a")
    with torch.no_grad():
        a, b = model(ids, vals, labels=ids, return_scores=True), loaded(ids, vals, labels=ids, return_scores=True)
    for name in ("loss", "loc_U", "scale_U", "loc_Y", "scale_Y", "loc_S", "scale_S"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    other = "qwen3_5" if arch != "qwen3_5" else "qwen3_next"
    with pytest.raises(ValueError, match=f"model_type='{arch}', but the base model has model_type='{other}'"):
        CausalModel.from_pretrained(tiny(other, dtype=torch.float32), tmp_path / "a")


def test_text_adapter_on_the_vision_language_checkpoint_of_the_same_language_model(tmp_path):
    text = tiny("qwen3_5", dtype=torch.float32)
    vl = tiny("qwen3_5", vision=True, dtype=torch.float32, seed=7)
    vl.get_decoder().load_state_dict(text.get_decoder().state_dict())
    vl.lm_head.load_state_dict(text.lm_head.state_dict())
    model = wrap(text, gamma0=2.0)
    perturb(model)
    model.save_pretrained(tmp_path / "frozen")
    loaded = CausalModel.from_pretrained(vl, tmp_path / "frozen")  # same family, H and V: accepted
    ids, mask = left_padded()
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask, return_scores=True), loaded(ids, attention_mask=mask, return_scores=True)
    torch.testing.assert_close(a.loc_S, b.loc_S, rtol=0, atol=1e-6)
    torch.testing.assert_close(a.loc_Y, b.loc_Y, rtol=0, atol=1e-6)
    wrap(tiny("qwen3_5", dtype=torch.float32), lora=LoraSettings(r=2)).save_pretrained(tmp_path / "lora")
    with pytest.raises(ValueError, match=r"missing \['lora.model.language_model.layers"):  # LoRA paths differ
        CausalModel.from_pretrained(tiny("qwen3_5", vision=True, dtype=torch.float32), tmp_path / "lora")


def test_unsupported_qwen_model_names_the_families():
    from transformers import Qwen2Model

    body = Qwen2Model(build_tiny_qwen("qwen2", hidden_size=16, num_layers=1, vocab_size=64).config)
    with pytest.raises(ValueError, match=r"unsupported base model Qwen2Model .*qwen3_next.*Qwen3\.5"):
        get_causal_model(body, CausalAdapterConfig(num_token_id=60))
