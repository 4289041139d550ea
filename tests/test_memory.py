"""Memory features (issue 19, item 7): activation (gradient) checkpointing through the backbone
(direct, train(), transformers.Trainer) and a bitsandbytes-quantised base (QLoRA)."""
import pytest
import torch

from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model
from causal_adapter.data import NumericCollator
from causal_adapter.train import TrainConfig, build_arg_parser, config_from_args, train
from conftest import adapter_tensors, assert_same_tensors, small_vocab_qwen

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
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 280, (seq,), generator=g)
        vals = torch.zeros(seq)
        ids[4], vals[4] = NUM, float(ids[0] % 7) + 0.5
        rows.append({"input_ids": ids.tolist(), "numeric_values": vals.tolist(), "labels": ids.tolist()})
    return rows


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
    model.decoder.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))  # pre: torch stops a recompute early
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

    from causal_adapter.hf_trainer import CausalTrainer

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
