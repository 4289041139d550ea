"""Mixed precision (docs/mixed_precision.md): heads and losses do not depend on autocast, adapter
weights in float32 on a bf16/fp16 base, the fused loss's GEMM precision option, host syncs and the
compiled kernel's fallback."""
import warnings
from pathlib import Path

import pytest
import torch

from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model
from causal_adapter.modeling import ovr_backends as loss_module  # the compiled kernel's state lives there
from causal_adapter.modeling.heads import linear_in_dtype
from causal_adapter.training.config import TrainConfig
from causal_adapter.modeling.loss import fused_ovr_loss, reference_ovr_loss
from conftest import small_vocab_qwen

NUM = 300  # <NUM> row of the small-vocabulary models (vocab 320)


def numeric_batch(seed=0, B=2, S=24, loc=400.0, spread=150.0):
    """input_ids with <NUM> at every third position (values around `loc`), labels = input_ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 290, (B, S), generator=g)
    ids[:, 1::3] = NUM
    values = torch.where(ids == NUM, loc + spread * torch.randn(B, S, generator=g), torch.zeros(B, S))
    return ids, values


def bf16_model(lora=True, **cfg):
    base = small_vocab_qwen(dtype=torch.bfloat16, seed=2)
    cfg.setdefault("num_token_id", NUM)
    cfg.setdefault("learnable_threshold", True)
    if lora:
        cfg["lora"] = LoraSettings(r=4, alpha=8)
    model = get_causal_model(base, CausalAdapterConfig(**cfg))
    model.set_value_units(400.0, 150.0)
    return model


def run(model, ids, values, autocast_dtype=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        out = model(ids, values, labels=ids)
    out.loss.backward()
    return out, {n: p.grad.detach().double().clone() for n, p in model.trainable_parameters()}


def cosine(a, b):
    a, b = a.flatten(), b.flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def test_bf16_autocast_matches_no_autocast():
    """A bf16 base under bf16 autocast: every adapter gradient within cosine 0.999 of the run without
    autocast (the <NUM> row was 0.90 with bf16 heads), loc_Y within 1% of value_scale."""
    model = bf16_model()
    ids, values = numeric_batch()
    ref, ref_grads = run(model, ids, values)
    amp, amp_grads = run(model, ids, values, torch.bfloat16)
    for t in (amp.loss, amp.loc_U, amp.scale_U, amp.loc_Y, amp.scale_Y):
        assert t.dtype == torch.float32
    assert (amp.loc_Y - ref.loc_Y).abs().max() <= 0.01 * 150.0
    assert set(amp_grads) == set(ref_grads) and any(n.startswith("backbone.") for n in ref_grads)
    worst = min((cosine(amp_grads[n], g), n) for n, g in ref_grads.items() if g.abs().sum() > 0)
    assert worst[0] >= 0.999, worst
    assert "action.num_row" in ref_grads


def test_fp16_autocast_with_grad_scaler():
    """fp16 base + CPU fp16 autocast: finite loss, and torch's GradScaler unscales the float32 adapter
    gradients (it refuses fp16 gradients, which a LoRA kept in the base dtype gives)."""
    base = small_vocab_qwen(dtype=torch.float16, seed=2)
    ids, values = numeric_batch()
    for keep_dtype in (False, True):
        model = get_causal_model(base if not keep_dtype else small_vocab_qwen(dtype=torch.float16, seed=2),
                                 CausalAdapterConfig(num_token_id=NUM, lora=LoraSettings(r=4, alpha=8),
                                                     autocast_adapter_dtype=not keep_dtype))
        params = [p for _, p in model.trainable_parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(ids, values, labels=ids)
        assert torch.isfinite(out.loss) and out.loss.dtype == torch.float32
        scaler.scale(out.loss).backward()
        if keep_dtype:
            with pytest.raises(ValueError, match="FP16 gradients"):
                scaler.unscale_(opt)
        else:
            assert {p.dtype for p in params} == {torch.float32}
            scaler.step(opt)
            scaler.update()


def test_lora_weights_float32_on_bf16_base_and_option_keeps_base_dtype(tmp_path):
    model = bf16_model()
    lora = {n: p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert lora and set(lora.values()) == {torch.float32}
    assert model.abduction.loc.weight.dtype == torch.float32
    kept = bf16_model(autocast_adapter_dtype=False)
    assert {p.dtype for _, p in kept.trainable_parameters()} == {torch.bfloat16}
    ids, values = numeric_batch()
    out = kept(ids, values, labels=ids)
    assert torch.isfinite(out.loss)
    # the saved dtype is the adapter's; the option round-trips and old adapters (without it) load as True
    kept.save_pretrained(tmp_path / "kept")
    again = type(kept).from_pretrained(small_vocab_qwen(dtype=torch.bfloat16, seed=2), tmp_path / "kept")
    assert again.causal_config.autocast_adapter_dtype is False and again.action.b_cls.dtype == torch.bfloat16
    cfg = CausalAdapterConfig(autocast_adapter_dtype=False)
    assert CausalAdapterConfig.from_json(cfg.to_json()) == cfg
    legacy = {k: v for k, v in CausalAdapterConfig().to_dict().items() if k != "autocast_adapter_dtype"}
    assert CausalAdapterConfig.from_dict(legacy).autocast_adapter_dtype is True
    with pytest.raises(ValueError, match="autocast_adapter_dtype"):
        CausalAdapterConfig(autocast_adapter_dtype="yes")


def test_linear_in_dtype_is_float32_accurate_on_a_bf16_weight(monkeypatch):
    """x float32 @ W bf16: as accurate as float32 (W upcast by chunks), not bf16-rounded."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(1000, 64, generator=g).bfloat16()
    x = torch.randn(3, 64, generator=g) * 30
    exact = x.double() @ W.double().T
    monkeypatch.setattr("causal_adapter.modeling.heads.LINEAR_CHUNK_ROWS", 256)  # several chunks
    got = linear_in_dtype(x, W)
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


# --------------------------------------------------------------------------- fused loss (item 6)
def loss_problem(n=40, V=600, C=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lu = torch.randn(n, C, generator=g, dtype=torch.float64) * 3
    su = torch.rand(n, C, generator=g, dtype=torch.float64) + 0.5
    W = torch.randn(V, C, generator=g, dtype=torch.float64) * 0.3
    W[7] = 0  # a zero row: the floor mask is needed in its block
    b = torch.randn(V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (n,), generator=g)
    return lu, su, W, b, y


def loss_and_grads(fn, lu, su, W, b, y, dtype=torch.float32, **kw):
    xs = [t.detach().to(dtype, copy=True).requires_grad_() for t in (lu, su, W, b)]
    loss = fn(*xs, torch.tensor(0.5, dtype=dtype), y, **kw)
    loss.backward()
    return loss.detach(), [x.grad for x in xs]


class SyncCounter:
    """Counts the Python-visible host syncs of tensors (bool/float/int/item/tolist)."""

    METHODS = ("__bool__", "__float__", "__int__", "item", "tolist")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.METHODS:
            orig = getattr(torch.Tensor, name)

            def counted(t, *a, _orig=orig, **k):
                self.count += 1
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_fused_loss_one_host_sync_per_step(monkeypatch):
    """16 blocks ([T, Vc] = [10, 150] over [40, 600]): the loss and gradients equal the reference, with
    at most 2 host syncs for forward + backward (30 before: per block, per chunk, grad_out)."""
    lu, su, W, b, y = loss_problem()
    ref_loss, ref_grads = loss_and_grads(reference_ovr_loss, lu, su, W, b, y, dtype=torch.float64)
    counter = SyncCounter(monkeypatch)
    loss, grads = loss_and_grads(fused_ovr_loss, lu, su, W, b, y, token_chunk=10, vocab_chunk=150, compile=False)
    assert counter.count <= 2, counter.count
    monkeypatch.undo()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-6 * r.abs().max().item())


def test_check_inputs_one_host_sync_and_clear_errors(monkeypatch):
    model = get_causal_model(small_vocab_qwen(), CausalAdapterConfig(num_token_id=NUM))
    ids, values = numeric_batch()
    mask = torch.ones_like(ids)
    counter = SyncCounter(monkeypatch)
    model.check_inputs(ids, values, ids, values, mask)
    assert counter.count == 1
    monkeypatch.undo()
    bad = ids.clone()
    bad[1, 4] = 999
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 320\); got 999 at index \(1, 4\)"):
        model.check_inputs(bad, values, ids, values, mask)
    padded = mask.clone()
    padded[0, 5] = 0
    with pytest.raises(ValueError, match=r"labels has a target .* at index \(0, 5\) where attention_mask is 0"):
        model.check_inputs(ids, values, ids, values, padded)


@pytest.mark.parametrize("where", ["compile", "first_call"])
def test_compiled_kernel_failure_falls_back_with_one_warning(monkeypatch, where):
    """torch.compile raising, or the compiled kernel failing at its first call after writing into the
    block: the loss and gradients equal the eager ones, the run goes on, one RuntimeWarning in all."""
    lu, su, W, b, y = loss_problem()
    kw = dict(token_chunk=10, vocab_chunk=150)
    eager_loss, eager_grads = loss_and_grads(fused_ovr_loss, lu, su, W, b, y, compile=False, **kw)
    monkeypatch.setattr(loss_module, "_compile_error", [])
    monkeypatch.setattr(loss_module, "_compiled_kernels", {})
    calls = []

    def failing_kernel(Zb, Sb, Lb, numel, floor, grads):
        calls.append(1)
        Zb.fill_(float("nan"))  # a partial write before the failure
        Sb.fill_(-1.0)
        raise RuntimeError("simulated Triton launch failure")

    def fake_compile(fn, **kwargs):
        if where == "compile":
            raise RuntimeError("simulated: no C++ compiler")
        return failing_kernel

    monkeypatch.setattr(torch, "compile", fake_compile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second call goes eager at once
            loss, grads = loss_and_grads(fused_ovr_loss, lu, su, W, b, y, compile=True, **kw)
            torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
            for g, r in zip(grads, eager_grads):
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning) and "torch.compile" in str(w.message)]
    assert len(runtime) == 1 and "simulated" in str(runtime[0].message)
    assert len(calls) == (1 if where == "first_call" else 0)
    assert loss_module._compile_error


def test_gemm_precision_option(monkeypatch):
    """fp32 is the default; tf32 / bf16 round the block GEMMs' operands (float32 accumulation): close to
    the float32 loss, not equal to it; a bad value names the choices; the environment sets the default."""
    lu, su, W, b, y = loss_problem()
    ref_loss, ref_grads = loss_and_grads(fused_ovr_loss, lu, su, W, b, y, dtype=torch.float64)
    base, _ = loss_and_grads(fused_ovr_loss, lu, su, W, b, y)
    assert torch.equal(base, loss_and_grads(fused_ovr_loss, lu, su, W, b, y, gemm_precision="fp32")[0])
    for p, tol in (("tf32", 2e-3), ("bf16", 2e-2)):
        loss, grads = loss_and_grads(fused_ovr_loss, lu, su, W, b, y, gemm_precision=p)
        assert not torch.equal(loss, base)
        assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))
        for g, r in zip(grads, ref_grads):
            assert cosine(g.double(), r) >= 0.9999
    monkeypatch.setenv(loss_module.GEMM_ENV, "bf16")
    assert torch.equal(loss_and_grads(fused_ovr_loss, lu, su, W, b, y)[0],
                       loss_and_grads(fused_ovr_loss, lu, su, W, b, y, gemm_precision="bf16")[0])
    with pytest.raises(ValueError, match="gemm_precision must be one of"):
        fused_ovr_loss(lu.float(), su.float(), W.float(), b.float(), 0.5, y, gemm_precision="fp16")


def test_train_bf16_fits_and_evaluates_the_value_head_without_autocast(tmp_path, monkeypatch):
    """train(mixed_precision="bf16") on a float32 base: the training steps run under bf16 autocast, while
    the value head's fits (before step 1, mid-run, after the last step) and the evaluations see the
    backbone as the saved adapter runs at inference, without autocast (accelerate's autocast forward
    swapped out, `engines.inference_precision`); LoRA stays float32; finite."""
    from accelerate.state import AcceleratorState

    from causal_adapter.training.value_head import warm_start
    from causal_adapter.training.loop import train
    from test_train import quick_config, small_model, synthetic_dataset

    where, inside = ["step"], []  # what runs now; the autocast state inside the decoder's forward, per call
    features = warm_start.label_rows  # what the fits gather their rows with

    def recording(model, *a, **k):
        where[0] = "fit"
        try:
            return features(model, *a, **k)
        finally:
            where[0] = "step"

    monkeypatch.setattr(warm_start, "label_rows", recording)
    model = small_model(lora=True)
    model.decoder.register_forward_pre_hook(lambda m, a: inside.append((where[0], torch.is_autocast_enabled("cpu"))))
    try:
        result = train(model, quick_config(tmp_path, mixed_precision="bf16", cpu=True, max_steps=2, eval_steps=1),
                       train_dataset=synthetic_dataset(), eval_dataset=synthetic_dataset(8, seed=1))
    finally:  # accelerate keeps bf16 in its process-wide state: a later train() would inherit it
        AcceleratorState._reset_state(reset_partial_state=True)
    fits = {on for kind, on in inside if kind == "fit"}
    assert fits == {False} and len([1 for kind, _ in inside if kind == "fit"]) >= 3  # start, mid-run, end
    # the training steps ran under autocast; the evaluations ran without it
    assert (("step", True) in inside) and (("step", False) in inside)
    assert result.eval_metrics is not None
    assert result.train_loss is not None and torch.isfinite(torch.tensor(result.train_loss))
    assert {p.dtype for n, p in result.model.named_parameters() if "lora_" in n} == {torch.float32}


def _test_value_mae(adapter_dir, corpus, tokenizer, tiny):
    """The test split's value MAE of a saved adapter as `causal-adapter eval --split test` computes it
    (a fresh float32 base, no autocast)."""
    from causal_adapter.data.corpora import build_corpus
    from causal_adapter.data.pipeline import tokenize_dataset
    from causal_adapter.numbers import NumberTokenizer
    from causal_adapter.saving.assets import load_base
    from causal_adapter.model import CausalModel
    from causal_adapter.training.metrics import evaluate_dataset

    base, _ = load_base(None, "qwen2", "float32", *tiny)
    model = CausalModel.from_pretrained(base, adapter_dir, tokenizer=tokenizer)
    ntok = NumberTokenizer(tokenizer, model.num_token_id)
    ds = tokenize_dataset(build_corpus(corpus)["test"], ntok)
    return float(evaluate_dataset(model, ds, ntok.pad_token_id, batch_size=16)["value_mae"])


@pytest.mark.slow  # four train / eval passes on the real vocabulary: ~40 s on 2 idle cores
def test_bf16_autocast_recipe_within_15_percent_of_fp32(tmp_path, qwen_tokenizer):
    """docs/mixed_precision.md, "The value under bf16 autocast", at toy size: `causal-adapter train --dataset sunspots --mixed-precision bf16` (CPU
    autocast) scores within 1.15x of the same run in fp32 on the test split, as `causal-adapter eval`
    scores it. With the value head fitted on the bf16-autocast features (the code before
    `engines.inference_precision`) the ratio is ~2 (the head reads feature differences below bf16's
    resolution; docs/mixed_precision.md)."""
    from accelerate.state import AcceleratorState

    from causal_adapter.training.loop import train

    tiny = (32, 1)
    mae = {}
    for mp in ("no", "bf16"):
        config = TrainConfig(dataset="sunspots", max_steps=6, mixed_precision=mp, cpu=True, plot=False, progress=False,
                             tiny_hidden_size=tiny[0], tiny_layers=tiny[1], output_dir=str(tmp_path / mp))
        try:
            result = train(config=config)
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
        mae[mp] = _test_value_mae(result.adapter_dir, "sunspots", qwen_tokenizer, tiny)
    assert mae["bf16"] <= 1.15 * mae["no"], mae


def test_value_head_fitted_on_float32_features_warns_under_bf16(tmp_path, qwen_tokenizer):
    """A value head fitted on float32 features (train on a float32 base) records them (value_fit_dtype,
    value_bf16_shift); run on 16-bit features (bf16 autocast, or the base in bf16) it warns once, naming the
    shift, since its values then move (an H100 under bf16 autocast: test MAE 40x with the head on loc_U alone,
    docs/mixed_precision.md). float32 inference, or a head whose bf16 shift is small, does not warn."""
    import warnings

    from accelerate.state import AcceleratorState

    from causal_adapter.config import BF16_MAX_SHIFT
    from causal_adapter.saving.assets import load_base
    from causal_adapter.model import CausalModel
    from causal_adapter.training.loop import train

    tiny = (32, 1)
    config = TrainConfig(dataset="sunspots", max_steps=2, recent_values=0, cpu=True, plot=False, progress=False,
                         tiny_hidden_size=tiny[0], tiny_layers=tiny[1], output_dir=str(tmp_path / "run"))
    try:
        result = train(config=config)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    prompt = ["Yearly sunspot numbers. 1975: 15.5; 1976: 12.6; 1977: 27.5; 1978: 92.5; 1979:"]

    def predict(dtype=torch.float32, autocast=False):
        base, _ = load_base(None, "qwen2", "float32", *tiny)
        model = CausalModel.from_pretrained(base.to(dtype), result.adapter_dir, tokenizer=qwen_tokenizer)
        with warnings.catch_warnings(record=True) as caught, \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            warnings.simplefilter("always")
            model.predict_values(prompt * 2, tokenizer=qwen_tokenizer, batch_size=1)  # two forwards, one warning
        cfg = model.causal_config
        return cfg, [str(w.message) for w in caught if "fitted on float32 features" in str(w.message)]

    cfg, quiet = predict()
    assert cfg.value_fit_dtype == "float32" and cfg.value_bf16_shift > BF16_MAX_SHIFT * cfg.value_scale, cfg
    assert quiet == []
    _, under_autocast = predict(autocast=True)
    assert len(under_autocast) == 1 and "autocast to torch.bfloat16" in under_autocast[0], under_autocast
    _, bf16_base = predict(dtype=torch.bfloat16)
    assert len(bf16_base) == 1 and "torch.bfloat16 base" in bf16_base[0], bf16_base
    # a head whose bf16 rounding moves nothing (the recent values alone, or a bounded penalty) stays quiet
    import json
    from causal_adapter.saving.artifacts import CONFIG_NAME
    path = Path(result.adapter_dir) / CONFIG_NAME
    meta = json.loads(path.read_text())
    meta["adapter_config"]["value_bf16_shift"] = 0.0
    path.write_text(json.dumps(meta))
    assert predict(autocast=True)[1] == []
