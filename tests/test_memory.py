"""Memory features (docs/memory.md): activation (gradient) checkpointing through the backbone
(direct, train(), transformers.Trainer) and a bitsandbytes-quantised base (QLoRA; these tests skip
unless bitsandbytes is installed: pip install -e '.[dev,quantization]')."""
import pytest
import torch

from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model
from causal_adapter.data.pipeline import NumericCollator
from causal_adapter.training.config import TrainConfig
from causal_adapter.commands.train import build_arg_parser, config_from_args
from causal_adapter.training.loop import train
from conftest import adapter_tensors, assert_same_tensors, small_vocab_qwen
from conftest import toy_rows as conftest_toy_rows

NUM = 300
LORA = LoraSettings(r=4, target_modules=["q_proj", "v_proj", "up_proj"])
#: the backbone gets gradients through LoRA, or through the learnable direction d only
TRAINED_BACKBONE = {"lora": dict(lora=LORA), "direction": dict(learnable_direction=True)}


def tiny_model(seed=0, **cfg):
    torch.manual_seed(seed)
    base = small_vocab_qwen(hidden_size=32, num_layers=2, seed=seed)
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM, **cfg))
    with torch.no_grad():  # lora_B starts at 0, which makes lora_A's gradient 0: give both a real one
        g = torch.Generator().manual_seed(seed + 1)
        for n, p in model.backbone.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def toy_rows(n=16, seq=9, seed=0):
    """Token rows with one <NUM> each (its value a function of the first token)."""
    return conftest_toy_rows(NUM, n, seq, seed, num_pos=4)


def toy_dataset(n=16):
    import datasets

    rows = toy_rows(n)
    return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]})


def backward_grads(model) -> dict[str, torch.Tensor]:
    model.train()
    batch = NumericCollator(0)(toy_rows(4))
    out = model(batch["input_ids"], batch["numeric_values"], labels=batch["labels"])
    out.loss.backward()
    return {n: p.grad.clone() for n, p in model.trainable_parameters()}


# ============================================================================ checkpointing
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("mode", list(TRAINED_BACKBONE))
def test_checkpointing_gives_the_gradients_of_a_plain_backward(mode, reentrant):
    reference = backward_grads(tiny_model(**TRAINED_BACKBONE[mode]))
    model = tiny_model(**TRAINED_BACKBONE[mode])
    assert not model.is_gradient_checkpointing
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert model.is_gradient_checkpointing and model.is_activation_checkpointing
    assert all(layer.gradient_checkpointing for layer in model.decoder.layers)
    got = backward_grads(model)
    backbone = [n for n in reference if n.startswith(("backbone.", "numeric_embedding."))]
    assert backbone and all(reference[n].abs().sum() > 0 for n in backbone)  # gradients that test something
    assert set(got) == set(reference)
    for n in reference:
        torch.testing.assert_close(got[n], reference[n], rtol=1e-5, atol=1e-7, msg=n)
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing


def test_checkpointing_recomputes_the_layers_in_backward():
    """Checkpointing is really on: each decoder layer runs twice per step (forward, then recompute)."""
    model = tiny_model(lora=LORA)
    calls = []
    # a pre-hook: torch's non-reentrant recompute stops early, before the MLP's forward hooks would run
    model.decoder.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    backward_grads(model)
    plain = len(calls)
    model.gradient_checkpointing_enable()
    backward_grads(model)
    assert (plain, len(calls) - plain) == (1, 2)


def test_frozen_backbone_needs_nothing():
    """A frozen backbone with a fixed d runs under no_grad: checkpointing on or off, same grads."""
    reference = backward_grads(tiny_model())
    model = tiny_model()
    model.gradient_checkpointing_enable()
    got = backward_grads(model)
    assert not any(n.startswith("backbone.") for n in got)
    assert_same_tensors(got, reference, exact=False)


def test_train_flag_matches_a_run_without_it(tmp_path):
    def run(name, checkpointing):
        model = tiny_model(lora=LORA, learnable_direction=True)
        config = TrainConfig(output_dir=str(tmp_path / name), plot=False, progress=False, max_steps=3,
                             per_device_train_batch_size=4, regression_init="none", calibrate_scale=False,
                             gradient_checkpointing=checkpointing)
        result = train(model, config, train_dataset=toy_dataset())
        assert result.model.is_gradient_checkpointing == checkpointing
        return adapter_tensors(result.model)

    plain, checkpointed = run("plain", False), run("checkpointed", True)
    assert any(not torch.equal(v, adapter_tensors(tiny_model(lora=LORA, learnable_direction=True))[k])
               for k, v in plain.items() if "lora_A" in k)  # the run trained the backbone's LoRA
    assert_same_tensors(checkpointed, plain, exact=False)


def test_cli_flag():
    assert config_from_args(build_arg_parser().parse_args(["--gradient-checkpointing"])).gradient_checkpointing
    assert not config_from_args(build_arg_parser().parse_args([])).gradient_checkpointing


def test_trainer_gradient_checkpointing_argument(tmp_path):
    from transformers import TrainingArguments

    from causal_adapter.saving.hf_trainer import CausalTrainer

    def run(name, checkpointing):
        model = tiny_model(lora=LORA, learnable_direction=True)
        args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=4,
                                 learning_rate=1e-2, save_strategy="no", use_cpu=True, report_to=[], seed=0,
                                 data_seed=0, lr_scheduler_type="constant", disable_tqdm=True,
                                 gradient_checkpointing=checkpointing)
        trainer = CausalTrainer(model=model, args=args, train_dataset=toy_dataset(), data_collator=NumericCollator(0))
        trainer.train()
        assert model.is_gradient_checkpointing == checkpointing
        return adapter_tensors(model)

    assert_same_tensors(run("checkpointed", True), run("plain", False), exact=False)


# ============================================================================ quantised base (bitsandbytes)
@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """An untied tiny Qwen saved to disk (bitsandbytes quantises while loading)."""
    path = tmp_path_factory.mktemp("base")
    small_vocab_qwen(hidden_size=64, num_layers=2, seed=0, tie_word_embeddings=False).save_pretrained(path)
    return path


def load_quantized(path, quantization, **kw):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from causal_adapter.saving.assets import bnb_config

    config = bnb_config(quantization, torch.float32) if not kw else BitsAndBytesConfig(**kw)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config)


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_lora_on_a_quantized_base(tmp_path, base_dir, quantization):
    bnb = pytest.importorskip("bitsandbytes")

    from causal_adapter import CausalModel

    base = load_quantized(base_dir, quantization)
    quantized = bnb.nn.Linear4bit if quantization == "4bit" else bnb.nn.Linear8bitLt
    assert isinstance(base.model.layers[0].self_attn.q_proj, quantized)
    batch = NumericCollator(0)(toy_rows(4))
    for m in base.modules():  # the reference in bitsandbytes' portable layout: the same on every CPU
        if hasattr(m, "support_avx512bf16_for_cpu"):  # (not its bf16 inference packing on AVX512-BF16 CPUs)
            m.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        base_logits = base(batch["input_ids"]).logits
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM, lora=LORA))
    assert isinstance(model.backbone.model.layers[0].self_attn.q_proj.base_layer, quantized)  # LoRA on top
    assert model.W_cls.dtype == model.abduction.loc.weight.dtype == model.action.b_cls.dtype == torch.float32
    with torch.no_grad():  # the adapter starts as the quantised base: loc_S = its logits
        loc_S = model(batch["input_ids"], return_scores=True).loc_S
    torch.testing.assert_close(loc_S, base_logits, rtol=1e-4, atol=1e-4)
    quantized_state = {n: p.detach().clone() for n, p in model.backbone.named_parameters() if "lora_" not in n}
    config = TrainConfig(output_dir=str(tmp_path / "run"), plot=False, progress=False, max_steps=3,
                         per_device_train_batch_size=4, regression_init="none", calibrate_scale=False,
                         learning_rate=5e-2)
    result = train(model, config, train_dataset=toy_dataset())
    trained = adapter_tensors(model)
    for k, v in trained.items():
        assert torch.isfinite(v).all(), k
        if "lora_B" in k:
            assert v.abs().sum() > 0, k  # lora_B starts at 0: LoRA on the quantised layers trained
    for n, p in model.backbone.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, quantized_state[n]), n
    model.eval()
    with torch.no_grad():
        expected = model(batch["input_ids"], batch["numeric_values"])
        reloaded = CausalModel.from_pretrained(load_quantized(base_dir, quantization), result.adapter_dir)
        got = reloaded(batch["input_ids"], batch["numeric_values"])
    assert_same_tensors(adapter_tensors(reloaded), trained)
    torch.testing.assert_close(got.loc_Y, expected.loc_Y)


def pack_for_cpu_inference(base):
    """What bitsandbytes does to each 4-bit layer at an eval-mode, no-grad forward on a CPU with AVX512-BF16:
    the weight moves to the inference-only packed layout and the layer keeps packing. Done by hand so the
    test runs the same on every CPU."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    layers = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = True
        m.weight.data, m.weight.quant_state = _convert_weight_packed_for_cpu(m.weight.data, m.weight.quant_state)
    return layers


@pytest.mark.parametrize("trainer", ["train", "CausalTrainer"])
def test_qlora_trains_after_cpu_inference_packing(tmp_path, base_dir, trainer):
    """A 4-bit base evaluated on an AVX512-BF16 CPU (weights packed for inference) still trains,
    and nothing repacks it during training (the run's own no-grad feature passes run in eval mode)."""
    pytest.importorskip("bitsandbytes")
    base = load_quantized(base_dir, "4bit", load_in_4bit=True, bnb_4bit_quant_type="nf4",
                          bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=["lm_head"])
    original = {n: p.detach().clone() for n, p in base.named_parameters()}
    layers = pack_for_cpu_inference(base)
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM, lora=LORA))
    assert layers and not any(m.weight.quant_state.packing_format_for_cpu or m.support_avx512bf16_for_cpu
                              for m in layers)
    if trainer == "train":
        train(model, TrainConfig(output_dir=str(tmp_path / "run"), plot=False, progress=False, max_steps=3,
                                 per_device_train_batch_size=4, regression_init="none", calibrate_scale=False,
                                 learning_rate=5e-2, eval_on_start=True), train_dataset=toy_dataset(),
              eval_dataset=toy_dataset(8))
    else:
        from transformers import TrainingArguments

        from causal_adapter.saving.hf_trainer import CausalTrainer

        args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=3, per_device_train_batch_size=4,
                                 learning_rate=5e-2, save_strategy="no", use_cpu=True, report_to=[],
                                 eval_strategy="steps", eval_steps=1, disable_tqdm=True)
        CausalTrainer(model=model, args=args, train_dataset=toy_dataset(), eval_dataset=toy_dataset(8),
                      data_collator=NumericCollator(0)).train()
    trained = dict(model.backbone.named_parameters())
    assert all(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)
    # the weights train in the layout they were loaded in (no double quantisation here: unpacking is exact)
    base_weights = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): p
                    for n, p in trained.items() if "lora_" not in n}
    assert base_weights.keys() == original.keys()
    for n, p in original.items():
        assert torch.equal(base_weights[n], p), n


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_a_quantized_lm_head_is_refused(base_dir, quantization):
    base = load_quantized(base_dir, quantization, **{f"load_in_{quantization}": True, "llm_int8_skip_modules": []})
    assert not base.lm_head.weight.dtype.is_floating_point  # what bitsandbytes does to a quantised lm_head
    with pytest.raises(ValueError, match=r"lm_head is quantised .*llm_int8_skip_modules=\['lm_head'\]"):
        get_causal_model(base, CausalAdapterConfig(num_token_id=NUM))


@pytest.mark.slow  # loads the real tokenizer from disk; importing bitsandbytes compiles its ops
def test_train_quantization_flag_runs_the_qlora_recipe(tmp_path, qwen_tokenizer):
    """`causal-adapter train --base-model DIR --quantization 4bit --lora --gradient-checkpointing`."""
    bnb = pytest.importorskip("bitsandbytes")
    from causal_adapter.saving.assets import build_tiny_qwen

    with pytest.raises(ValueError, match="--quantization needs --base-model"):
        TrainConfig(quantization="4bit")
    base_dir = tmp_path / "base"  # the real vocabulary: the real tokenizer's len() is the <NUM> row
    build_tiny_qwen("qwen3", hidden_size=64, num_layers=1, tie_word_embeddings=False).save_pretrained(base_dir)
    qwen_tokenizer.save_pretrained(base_dir)
    args = build_arg_parser().parse_args([
        "--base-model", str(base_dir), "--quantization", "4bit", "--lora", "--lora-target-modules", "q_proj",
        "v_proj", "--gradient-checkpointing", "--max-steps", "1", "--max-train-samples", "4",
        "--max-eval-samples", "2", "--per-device-train-batch-size", "4", "--regression-init", "none",
        "--corpus-window", "4",
        "--output-dir", str(tmp_path / "run"), "--no-plot", "--no-progress"])
    result = train(config=config_from_args(args))
    model = result.model
    assert isinstance(model.backbone.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    assert model.is_gradient_checkpointing and model.W_cls.dtype == torch.float32
    lora_B = [v for k, v in adapter_tensors(model).items() if "lora_B" in k]
    assert lora_B and all(v.abs().sum() > 0 for v in lora_B)
    assert result.eval_metrics is not None
