"""Core adapter: init equivalence, forward math, loss, gradients, frozen/LoRA modes."""
import math

import pytest
import torch

from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model, verify_initialization
from causal_adapter.saving.assets import QWEN_VOCAB_SIZE, build_tiny_qwen
from conftest import small_vocab_qwen

NUM_SMALL = 300  # <NUM> row in the small-vocabulary models (vocab 320)


def wrap(base, **cfg):
    cfg.setdefault("num_token_id", NUM_SMALL if base.config.vocab_size == 320 else None)
    return get_causal_model(base, CausalAdapterConfig(**cfg))


def rand_ids(vocab, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g)


# --------------------------------------------------------------------------- init equivalence
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_init_reproduces_base_logits_float64_real_vocab(arch, qwen_tokenizer):
    base = build_tiny_qwen(arch, dtype=torch.float64, seed=1)
    assert base.config.vocab_size == QWEN_VOCAB_SIZE
    assert (base.lm_head.weight is base.model.embed_tokens.weight) == (arch == "qwen2")
    model = get_causal_model(base, CausalAdapterConfig(), tokenizer=qwen_tokenizer)
    assert model.num_token_id == len(qwen_tokenizer) == 151_669
    ids = qwen_tokenizer(["The quick brown fox jumps over the lazy dog.", "价格是多少？"],
                         padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(ids["input_ids"], attention_mask=ids["attention_mask"], return_scores=True)
        ref = base(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"], output_hidden_states=True)
    assert out.loc_S.shape == (2, ids["input_ids"].shape[1], QWEN_VOCAB_SIZE)
    assert (out.loc_S - ref.logits).abs().max().item() <= 1e-10
    # text without numbers: the backbone sees exactly the base embeddings -> identical features
    assert torch.equal(out.hidden_states, ref.hidden_states[-1])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_init_reproduces_base_logits_float32(arch):
    base = build_tiny_qwen(arch, seed=2)
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=151_665))
    ids = rand_ids(151_000, (3, 11), seed=3)
    with torch.no_grad():
        out = model(ids, torch.zeros(3, 11), return_scores=True)
        logits = base(input_ids=ids).logits
    tol = 1e-4 * logits.abs().max().item()
    assert (out.loc_S - logits).abs().max().item() <= tol
    kl = torch.nn.functional.kl_div(out.loc_S.log_softmax(-1), logits.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert kl.item() < 1e-7
    assert torch.equal(out.loc_S.argmax(-1), logits.argmax(-1))


def test_verify_initialization_report(qwen_tokenizer):
    base = build_tiny_qwen("qwen3", seed=4)
    model = get_causal_model(base, tokenizer=qwen_tokenizer)
    ids = qwen_tokenizer("Hello world, this is a test.", return_tensors="pt")["input_ids"]
    report = verify_initialization(model, base, ids)
    assert report["feature_diff"] == 0.0
    assert report["loc_diff"] == 0.0
    assert report["scale_U_mean"] == pytest.approx(10.0, rel=1e-6)
    assert report["scale_U_std"] < 1e-5
    assert report["logits_rel_diff"] < 1e-6
    assert report["kl_softmax"] < 1e-8
    assert report["greedy_agreement"] == 1.0
    assert 0.0 < report["ovr_p_min"] <= report["ovr_p_mean"] <= report["ovr_p_max"] < 0.5  # C = 100 >> logits
    assert "logits_max_abs_diff" in str(report)


def test_numbers_only_change_num_positions_embeddings():
    base = small_vocab_qwen()
    model = wrap(base)
    ids = rand_ids(290, (1, 6))
    ids[0, 2] = NUM_SMALL
    vals = torch.zeros(1, 6)
    vals[0, 2] = 99.9
    e = model.embed(ids, vals)
    e0 = base.get_input_embeddings()(ids)
    assert torch.equal(e[0, [0, 1, 3, 4, 5]], e0[0, [0, 1, 3, 4, 5]])
    d = model.numeric_embedding.direction
    # |d| defaults to the median norm of the embedding rows; direction_norm=1.0 gives the seeds' unit vector
    row_norms = base.get_input_embeddings().weight.detach().norm(dim=1)
    assert d.norm().item() == pytest.approx(row_norms.median().item(), rel=1e-5)
    unit = wrap(small_vocab_qwen(), direction_norm=1.0)
    assert unit.numeric_embedding.direction.norm().item() == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(unit.numeric_embedding.direction, d / d.norm())
    torch.testing.assert_close(e[0, 2] - e0[0, 2], math.log(100.9) * d, rtol=1e-5, atol=1e-6)
    vals[0, 2] = -99.9
    torch.testing.assert_close(model.embed(ids, vals)[0, 2] - e0[0, 2], -math.log(100.9) * d, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- forward math
def test_forward_closed_forms_at_init():
    base = small_vocab_qwen(dtype=torch.float64)
    model = wrap(base, gamma0=7.0, b_noise_init=-0.3, threshold_init=50.0)
    ids = rand_ids(290, (2, 5))
    with torch.no_grad():
        out = model(ids, return_scores=True)
    torch.testing.assert_close(out.scale_U, torch.full_like(out.scale_U, 7.0), rtol=1e-12, atol=0)
    W = base.lm_head.weight.double()
    expected_scale_S = W.abs().sum(-1) * (7.0 + 0.3)  # |W| (gamma0 + |b_noise|) 1
    torch.testing.assert_close(out.scale_S, expected_scale_S.expand_as(out.scale_S), rtol=1e-12, atol=0)
    expected_loc_Y = out.hidden_states @ model.action.w_reg
    torch.testing.assert_close(out.loc_Y, expected_loc_Y, rtol=1e-12, atol=1e-12)
    # default regression scale: |b_noise_Y| (independent), raw units until set
    expected_scale_Y = 1.0
    torch.testing.assert_close(out.scale_Y, torch.full_like(out.scale_Y, expected_scale_Y))
    # value units map loc and scale exactly: Y = value_loc + value_scale * Y'
    model.set_value_units(40.0, 25.0)
    with torch.no_grad():
        mapped = model(ids)
    torch.testing.assert_close(mapped.loc_Y, 40.0 + 25.0 * expected_loc_Y, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(mapped.scale_Y, 25.0 * out.scale_Y, rtol=1e-12, atol=0)
    shared = wrap(small_vocab_qwen(dtype=torch.float64), gamma0=7.0, b_noise_init=-0.3, regression_scale="shared")
    with torch.no_grad():
        shared_scale_Y = shared(ids).scale_Y
    torch.testing.assert_close(shared_scale_Y, torch.full_like(shared_scale_Y, 7.3 * shared.action.w_reg.abs().sum().item()))
    # OvR probability formula, independently
    P = 0.5 + torch.atan((out.loc_S - 50.0) / out.scale_S) / math.pi
    from causal_adapter.modeling.cauchy import ovr_probability

    torch.testing.assert_close(ovr_probability(out.loc_S, out.scale_S, model.action.thresholds), P)


def test_outputs_that_carry_gradients_are_not_views():
    """FSDP2 registers its pre-backward hook on the root's outputs and warns when one is a view (an in-place op
    on it would drop the hook: no all-gather, wrong gradients). loc_U came from nn.Linear's 3-D path, a view of
    a flattened addmm; every tensor output must be a tensor of its own, with and without LoRA."""
    for lora in (None, LoraSettings(r=2, target_modules=["q_proj"])):
        model = wrap(small_vocab_qwen(), lora=lora)
        model.train()
        ids = rand_ids(290, (2, 6))
        out = model(ids, labels=ids, return_scores=True)
        grad_outputs = {k: v for k, v in out.items() if torch.is_tensor(v) and v.requires_grad}
        assert {"loc_U", "scale_U", "loc_Y", "scale_Y", "loss"} <= set(grad_outputs)
        assert [k for k, v in grad_outputs.items() if v._base is not None] == []


def test_zero_row_never_gives_nan():
    base = small_vocab_qwen()
    with torch.no_grad():
        base.lm_head.weight[NUM_SMALL].zero_()
    model = wrap(base)
    ids = rand_ids(290, (1, 6))
    labels = ids.clone()
    labels[0, 3] = NUM_SMALL  # the zero row is a target
    vals = torch.zeros(1, 6)
    out = model(ids, labels=labels, label_values=vals, return_scores=True)
    assert out.scale_S[..., NUM_SMALL].min().item() == torch.tensor(model.causal_config.scale_floor).item()
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for n, p in model.trainable_parameters():
        assert torch.isfinite(p.grad).all(), n


def _manual_loss(model, out, labels, values):
    """The loss of SPEC 3 written out from the full scores, independent of the model's loss path."""
    loc_S, scale_S = out.loc_S[:, :-1].flatten(0, 1), out.scale_S[:, :-1].flatten(0, 1)
    y, v = labels[:, 1:].flatten(), values[:, 1:].flatten()
    keep = y != -100
    P = 0.5 + torch.atan((loc_S[keep] - model.action.thresholds) / scale_S[keep]) / math.pi
    onehot = torch.nn.functional.one_hot(y[keep], P.shape[-1]).double()
    l_cls = -(onehot * P.log() + (1 - onehot) * (1 - P).log()).sum(-1).mean()
    m = y[keep] == model.num_token_id
    loc_Y, scale_Y = out.loc_Y[:, :-1].flatten()[keep], out.scale_Y[:, :-1].flatten()[keep]
    nll = torch.log(math.pi * scale_Y) + torch.log1p(((v[keep] - loc_Y) / scale_Y) ** 2)
    gate = m * (model.causal_config.alpha + (1 - model.causal_config.alpha) * P[:, model.num_token_id])
    l_reg = (gate * nll).sum() / max(1, int(m.sum()))
    return l_cls, l_reg


@pytest.mark.parametrize("fused", [True, False])
def test_loss_matches_written_out_formula(fused):
    base = small_vocab_qwen(dtype=torch.float64)
    model = wrap(base, alpha=0.25, reg_weight=0.5, fused_loss=fused, threshold_init=2.0, gamma0=1.0)
    with torch.no_grad():  # move the heads off their init so every term matters
        model.action.b_cls.normal_(0, 1)
        model.action.num_row.add_(1.0)
    ids = rand_ids(290, (2, 7), seed=5)
    ids[0, 3] = ids[1, 2] = ids[1, 5] = NUM_SMALL
    vals = torch.zeros(2, 7, dtype=torch.float64)
    vals[0, 3], vals[1, 2], vals[1, 5] = 12.5, -3.0, 1e6
    labels = ids.clone()
    labels[1, :2] = -100  # prompt
    out = model(ids, vals, labels=labels, return_scores=True)
    l_cls, l_reg = _manual_loss(model, out, labels, vals)
    torch.testing.assert_close(out.loss_cls, l_cls, rtol=1e-10, atol=0)
    torch.testing.assert_close(out.loss_reg, l_reg, rtol=1e-10, atol=0)
    torch.testing.assert_close(out.loss, l_cls + 0.5 * l_reg, rtol=1e-10, atol=0)


def test_all_labels_ignored_gives_zero_loss():
    model = wrap(small_vocab_qwen())
    ids = rand_ids(290, (1, 5))
    out = model(ids, labels=torch.full_like(ids, -100))
    assert out.loss.item() == 0.0 and out.loss_cls.item() == 0.0 and out.loss_reg.item() == 0.0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for _, p in model.trainable_parameters() if p.grad is not None)


def test_gate_is_detached():
    """L_reg must not be lowered by pushing P_num down: no gradient from L_reg into the <NUM> score."""
    base = small_vocab_qwen(dtype=torch.float64)
    model = wrap(base, alpha=0.0, gamma0=1.0, threshold_init=0.0)
    ids = rand_ids(290, (1, 6))
    ids[0, 4] = NUM_SMALL
    vals = torch.zeros(1, 6, dtype=torch.float64)
    vals[0, 4] = 42.0
    out = model(ids, vals, labels=ids)
    assert out.loss_reg.item() != 0.0
    g_bnum, g_row = torch.autograd.grad(out.loss_reg, [model.action.b_cls, model.action.num_row], allow_unused=True)
    assert (g_bnum is None or g_bnum.abs().max().item() == 0.0) and (g_row is None or g_row.abs().max().item() == 0.0)
    # ...while the regression head does get a gradient
    (g_wreg,) = torch.autograd.grad(model(ids, vals, labels=ids).loss_reg, [model.action.w_reg])
    assert g_wreg.abs().max().item() > 0


class _HeadsLoss(torch.nn.Module):
    """z -> the model's loss, with the heads as submodules so functional_call can swap parameters."""

    def __init__(self, model, ids, vals):
        super().__init__()
        self.abduction, self.action = model.abduction, model.action
        self._model, self._ids, self._vals = [model], ids, vals

    def forward(self, z):
        loc_U, scale_U = self.abduction(z)
        scale_Up = self.action.noisy_scale(scale_U)
        loc_Y, scale_Y = self.action.regression(loc_U, scale_Up)
        return self._model[0].loss(loc_U, scale_Up, loc_Y, scale_Y, self._ids, self._vals)[0]


def test_gradcheck_head_parameters():
    from torch.func import functional_call

    base = small_vocab_qwen(dtype=torch.float64, hidden_size=16)
    # alpha = 1: the gate is then exactly m_i; with alpha < 1 the detached P_num makes the true
    # derivative differ from the analytical one on purpose (test_gate_is_detached covers that)
    model = wrap(base, gamma0=1.0, threshold_init=1.0, learnable_threshold=True, threshold_mode="vector", alpha=1.0)
    ids = rand_ids(290, (1, 5), seed=7)
    ids[0, 2] = NUM_SMALL
    vals = torch.zeros(1, 5, dtype=torch.float64)
    vals[0, 2] = 3.5
    with torch.no_grad():
        z = model.decoder(inputs_embeds=model.embed(ids, vals)).last_hidden_state
    heads = _HeadsLoss(model, ids, vals)
    names = ["abduction.loc.weight", "abduction.scale.weight", "abduction.scale.bias", "action.b_noise",
             "action.b_cls", "action.thresholds", "action.w_reg", "action.b_reg", "action.num_row"]
    params = dict(heads.named_parameters())
    inputs = tuple(params[n].detach().clone().requires_grad_(True) for n in names)

    def fn(*ps):
        return functional_call(heads, dict(zip(names, ps)), (z,))

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


# --------------------------------------------------------------------------- modes
def test_frozen_backbone_gets_no_gradient_and_runs_without_graph():
    base = small_vocab_qwen()
    model = wrap(base)
    assert all(not p.requires_grad for p in base.parameters())
    assert not model.backbone_needs_grad()
    seen = []
    handle = model.decoder.norm.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad))
    ids = rand_ids(290, (2, 6))
    out = model(ids, labels=ids)
    handle.remove()
    assert seen == [False]  # the transformer ran under no_grad: no activations kept
    out.loss.backward()
    assert all(p.grad is None for p in base.parameters())
    names = {n for n, _ in model.trainable_parameters()}
    assert names == {"abduction.loc.weight", "abduction.loc.bias", "abduction.scale.weight", "abduction.scale.bias",
                     "action.b_noise", "action.b_cls", "action.num_row", "action.w_reg", "action.b_reg",
                     "action.b_noise_Y", "action.w_scale_Y"}
    assert model.action.num_row.grad.abs().sum() > 0


def test_lora_mode_trains_lora_only_in_backbone():
    base = small_vocab_qwen("qwen3")
    model = wrap(base, lora=LoraSettings(r=4, target_modules=["q_proj", "v_proj"]))
    lora = [n for n, p in model.backbone.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)
    assert model.backbone_needs_grad()
    ids = rand_ids(290, (2, 6))
    with torch.no_grad():  # LoRA B starts at zero: the init guarantee still holds
        ref = base(input_ids=ids).logits
        torch.testing.assert_close(model(ids, return_scores=True).loc_S, ref, rtol=1e-5, atol=1e-5)
    opt = torch.optim.AdamW([p for _, p in model.trainable_parameters()], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.backbone.named_parameters() if p.requires_grad}
    for _ in range(2):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    changed = [n for n, p in model.backbone.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in changed) and any("lora_A" in n for n in changed)
    frozen = [p for n, p in model.backbone.named_parameters() if "lora_" not in n]
    assert all(p.grad is None for p in frozen)


def test_lora_init_follows_config_seed_not_the_global_rng():
    settings = LoraSettings(r=4, target_modules=["q_proj", "v_proj"])

    def lora_A(global_seed, seed):
        base = small_vocab_qwen("qwen3")
        torch.manual_seed(global_seed)
        model = wrap(base, lora=settings, seed=seed)
        after = torch.rand(1)  # the caller's stream continues as if nothing was drawn
        torch.manual_seed(global_seed)
        assert torch.equal(after, torch.rand(1))
        return {n: p.detach().clone() for n, p in model.backbone.named_parameters() if "lora_A" in n}

    a, b, c = lora_A(1, seed=7), lora_A(2, seed=7), lora_A(1, seed=8)
    assert a and a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # same config.seed, different global RNG
    assert not any(torch.equal(a[k], c[k]) for k in a)


def test_learnable_direction_backpropagates_through_backbone():
    model = wrap(small_vocab_qwen(), learnable_direction=True)
    assert model.backbone_needs_grad()
    ids = rand_ids(290, (1, 6))
    ids[0, 2] = NUM_SMALL
    vals = torch.zeros(1, 6)
    vals[0, 2] = 5.0
    model(ids, vals, labels=ids).loss.backward()
    assert model.numeric_embedding.direction.grad.abs().sum() > 0


def test_model_loss_with_the_compiled_kernel_equals_eager(monkeypatch):
    """CAUSAL_ADAPTER_COMPILE_LOSS=1 (what a GPU gets by default for batches with N x V >= 2^24)
    routes the model's loss through the torch.compile'd block kernel; loss and head gradients
    equal the eager kernel's."""
    from causal_adapter.modeling import ovr_fused  # the sweep that calls the compiled kernel
    from causal_adapter.modeling import ovr_loss as loss_module

    monkeypatch.setenv(loss_module.COMPILE_ENV, "1")
    model = wrap(build_tiny_qwen("qwen3", hidden_size=32, num_layers=1, vocab_size=QWEN_VOCAB_SIZE, seed=3),
                 num_token_id=151669)
    ids = rand_ids(151000, (2, 64), seed=4)
    assert ids.numel() * QWEN_VOCAB_SIZE >= loss_module.COMPILE_MIN_ELEMENTS

    def run():
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.trainable_parameters()}

    calls = []
    monkeypatch.setattr(ovr_fused, "_run_compiled_kernel",
                        lambda *a, _f=ovr_fused._run_compiled_kernel: calls.append(1) or _f(*a))
    compiled_loss, compiled_grads = run()
    assert calls and not loss_module._compile_error
    monkeypatch.setenv(loss_module.COMPILE_ENV, "0")
    n_calls = len(calls)
    eager_loss, eager_grads = run()
    assert len(calls) == n_calls  # the environment variable switches it off
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=0)
    for name, g in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], g, rtol=1e-4, atol=1e-6 * g.abs().max().item(), msg=name)


def test_bf16_backbone_with_fp32_heads():
    base = small_vocab_qwen(dtype=torch.bfloat16)
    model = wrap(base)
    assert model.abduction.loc.weight.dtype == torch.float32
    ids = rand_ids(290, (2, 6))
    out = model(ids, labels=ids, return_scores=True)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    with torch.no_grad():
        ref = base(input_ids=ids).logits.float()
    assert (out.loc_S - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    out.loss.backward()


def test_print_trainable_parameters(capsys):
    base = small_vocab_qwen()
    model = wrap(base)
    model.print_trainable_parameters()
    line = capsys.readouterr().out.strip()
    trainable, total = model.get_nb_trainable_parameters()
    H, V = 32, 320
    assert trainable == 2 * (H * H + H) + H + V + H + H + 1 + 1 + H  # ... w_reg, b_reg, b_noise_Y, w_scale_Y
    assert total == sum(p.numel() for p in base.parameters()) + trainable
    assert line == f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}"


# --------------------------------------------------------------------------- input checks
def test_bad_inputs_raise_clear_errors():
    model = wrap(small_vocab_qwen())
    ids = rand_ids(290, (1, 5))
    with pytest.raises(ValueError, match="numeric_values has shape"):
        model(ids, torch.zeros(1, 4))
    v = torch.zeros(1, 5)
    v[0, 1] = 3.0
    with pytest.raises(ValueError, match="not <NUM>"):
        model(ids, v)
    ids2 = ids.clone()
    ids2[0, 1] = NUM_SMALL
    v[0, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        model(ids2, v)
    with pytest.raises(ValueError, match=r"labels must be -100 or in \[0, 320\); got 999"):
        model(ids, labels=torch.full_like(ids, 999))


def test_num_token_id_resolution(qwen_tokenizer):
    base = build_tiny_qwen("qwen2", seed=0)
    assert get_causal_model(base, tokenizer=qwen_tokenizer).num_token_id == len(qwen_tokenizer)
    with pytest.raises(ValueError, match="cannot determine the <NUM> token id"):
        get_causal_model(build_tiny_qwen("qwen2", seed=0))
    small = small_vocab_qwen(vocab_size=320)
    with pytest.raises(ValueError, match="no reserved embedding row"):
        get_causal_model(small, tokenizer=qwen_tokenizer)  # 151,669 tokens > 320 rows
    with pytest.raises(ValueError, match="outside the model's 320 embedding rows"):
        get_causal_model(small, CausalAdapterConfig(num_token_id=320))


def test_unsupported_model_and_config_errors():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="unsupported base model LlamaForCausalLM"):
        get_causal_model(llama, CausalAdapterConfig(num_token_id=60))
    with pytest.raises(ValueError, match="causal_size=16 must equal the backbone hidden size 32"):
        wrap(small_vocab_qwen(), causal_size=16)
    with pytest.raises(ValueError, match="do not match the backbone"):
        wrap(small_vocab_qwen(), lora=LoraSettings(target_modules=["not_a_module"]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(gamma0=0.0), "gamma0 must be > 0"),
    (dict(gamma0=float("nan")), "gamma0 must be a finite number"),
    (dict(alpha=1.5), r"alpha must be in \[0, 1\]"),
    (dict(reg_weight=-1.0), "reg_weight"),
    (dict(causal_size=0), "causal_size must be a positive integer"),
    (dict(threshold_mode="matrix"), "threshold_mode"),
    (dict(threshold_init=float("inf")), "threshold_init must be a finite number"),
    (dict(lora=dict(r=0)), "lora.r must be a positive integer"),
    (dict(lora=dict(target_modules=["lm_head"])), "full V x H matrices"),
    (dict(num_token_id=-1), "num_token_id"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CausalAdapterConfig(**kwargs)


def test_config_json_round_trip():
    cfg = CausalAdapterConfig(gamma0=3.0, alpha=0.2, lora=LoraSettings(r=2, target_modules=["q_proj"]),
                              threshold_mode="vector", learnable_threshold=True, num_token_id=7)
    again = CausalAdapterConfig.from_json(cfg.to_json())
    assert again == cfg and isinstance(again.lora, LoraSettings)
    with pytest.raises(ValueError, match="unknown CausalAdapterConfig fields"):
        CausalAdapterConfig.from_dict({"gamma_zero": 1.0})
