"""The Hugging Face tools users already run, against the real libraries (docs/integrations.md):
transformers.Trainer, accelerate save_state/load_state, peft loaders, from_pretrained, hub, generate."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from causal_adapter import CausalAdapterConfig, CausalModel, LoraSettings, get_causal_model
from causal_adapter.saving.artifacts import CONFIG_NAME, LEGACY_CONFIG_NAME, LEGACY_WEIGHTS_NAME, WEIGHTS_NAME
from causal_adapter.data.pipeline import NumericCollator
from conftest import adapter_tensors, assert_same_tensors, small_vocab_qwen
from conftest import toy_rows as conftest_toy_rows

V, NUM, H = 320, 300, 32
LORA = LoraSettings(r=4, target_modules=["q_proj", "v_proj"])


def tiny_base(arch="qwen2", tie=None, seed=0):
    return small_vocab_qwen(arch, vocab_size=V, hidden_size=H, num_layers=2, seed=seed, tie_word_embeddings=tie)


def tiny_model(arch="qwen2", tie=None, lora=None, **cfg):
    return get_causal_model(tiny_base(arch, tie), CausalAdapterConfig(num_token_id=NUM, lora=lora, **cfg))


def toy_rows(n=24, seq=10, seed=0):
    """Token rows with one <NUM> each (value = a function of the first token): a learnable toy task."""
    return conftest_toy_rows(NUM, n, seq, seed, num_pos=5)


def toy_dataset(n=24, seed=0):
    import datasets

    rows = toy_rows(n, seed=seed)
    return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]})


def base_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.backbone.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def assert_adapter_only(directory: Path, model):
    """No tensor of the base in any file: no file as big as one V x H matrix, no backbone name."""
    matrix = V * H * 4
    for f in directory.rglob("*"):
        if f.is_file():
            assert f.stat().st_size < max(matrix, 64_000) or f.suffix == ".pt", (f, f.stat().st_size)
        if f.suffix == ".safetensors":
            for k, t in load_file(str(f)).items():
                assert "lora_" in k or not any(s in k for s in ("embed_tokens", "lm_head", "layers.", "norm")), k
                assert t.numel() < V * H, k


# ============================================================================ Trainer
def trainer_args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                save_steps=2, save_strategy="steps", logging_steps=1, use_cpu=True, report_to=[], seed=0,
                data_seed=0, lr_scheduler_type="constant", dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def make_trainer(model, out, eval_dataset=None, **kw):
    from causal_adapter.saving.hf_trainer import CausalTrainer

    return CausalTrainer(model=model, args=trainer_args(out, **kw), train_dataset=toy_dataset(),
                         eval_dataset=eval_dataset, data_collator=NumericCollator(0))


@pytest.mark.parametrize("tie, lora", [(True, None), (False, LORA)], ids=["tied-frozen", "untied-lora"])
def test_trainer_adapter_only_checkpoints_resume_and_final_load(tmp_path, tie, lora):
    model = tiny_model(tie=tie, lora=lora)
    init = adapter_tensors(model)
    trainer = make_trainer(model, tmp_path / "run")
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(map(lambda x: x == x, losses))
    final = adapter_tensors(model)
    assert not torch.equal(final["action.b_cls"], init["action.b_cls"])
    ckpts = sorted((tmp_path / "run").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [c.name for c in ckpts] == ["checkpoint-2", "checkpoint-4"]
    for ck in ckpts:
        names = {p.name for p in ck.iterdir()}
        assert {CONFIG_NAME, WEIGHTS_NAME, "optimizer.pt", "trainer_state.json"} <= names
        assert "model.safetensors" not in names and "pytorch_model.bin" not in names
        assert_adapter_only(ck, model)
        size = sum(f.stat().st_size for f in ck.iterdir() if f.name in (WEIGHTS_NAME, CONFIG_NAME))
        assert size < base_bytes(model) / 5, (size, base_bytes(model))
    # the final checkpoint loads with CausalModel.from_pretrained and equals the trained adapter
    loaded = CausalModel.from_pretrained(tiny_base(tie=tie), ckpts[-1])
    assert_same_tensors(adapter_tensors(loaded), final)
    # resume from checkpoint-2 in a fresh model: ends with the same adapter as the uninterrupted run
    model2 = tiny_model(tie=tie, lora=lora)
    trainer2 = make_trainer(model2, tmp_path / "run")
    trainer2.train(resume_from_checkpoint=str(ckpts[0]))
    assert_same_tensors(adapter_tensors(model2), final, exact=False)
    assert result.global_step == 4


def test_trainer_save_model_keeps_checkpoints_and_best_model_reloads(tmp_path):
    model = tiny_model()
    trainer = make_trainer(model, tmp_path / "run", eval_dataset=toy_dataset(8, seed=1), eval_strategy="steps",
                           eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
                           greater_is_better=False, prediction_loss_only=True)
    trainer.train()
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    best = Path(trainer.state.best_model_checkpoint)
    assert best.name == f"checkpoint-{min(evals, key=evals.get)}"
    # load_best_model_at_end put the best checkpoint's adapter into the model (here checkpoint-2: the
    # toy eval loss rises after it, so the model was really reloaded)
    assert_same_tensors(adapter_tensors(model), adapter_tensors(CausalModel.from_pretrained(tiny_base(), best)))
    last = adapter_tensors(CausalModel.from_pretrained(tiny_base(), tmp_path / "run" / "checkpoint-4"))
    assert best.name == "checkpoint-4" or not torch.equal(adapter_tensors(model)["action.b_cls"], last["action.b_cls"])
    trainer.save_model()  # into output_dir, which holds the checkpoints: they stay
    out = tmp_path / "run"
    assert (out / "checkpoint-2" / WEIGHTS_NAME).is_file() and (out / "checkpoint-4" / WEIGHTS_NAME).is_file()
    assert (out / CONFIG_NAME).is_file() and (out / "README.md").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".causal_adapter.tmp")]
    assert_same_tensors(adapter_tensors(CausalModel.from_pretrained(tiny_base(), out)), adapter_tensors(model))


# ============================================================================ accelerate
def accelerate_run(model, steps=3):
    from accelerate import Accelerator

    from causal_adapter.saving.accelerate_hooks import register_accelerate_hooks

    acc = Accelerator(cpu=True)
    register_accelerate_hooks(acc)
    opt = torch.optim.AdamW([p for _, p in model.trainable_parameters()], lr=1e-2)
    pmodel, opt = acc.prepare(model, opt)
    batch = NumericCollator(0)(toy_rows(8))
    for _ in range(steps):
        loss = pmodel(**batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    return acc, pmodel, opt, batch


@pytest.mark.parametrize("tie, lora", [(True, None), (False, LORA)], ids=["tied-frozen", "untied-lora"])
def test_accelerate_save_state_load_state_adapter_only(tmp_path, tie, lora):
    model = tiny_model(tie=tie, lora=lora)
    acc, pmodel, opt, batch = accelerate_run(model)
    saved = adapter_tensors(model)
    opt_state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items() if torch.is_tensor(v)}
    acc.save_state(str(tmp_path / "state"))
    names = {p.name for p in (tmp_path / "state").iterdir()}
    assert "causal_adapter" in names and not names & {"model.safetensors", "pytorch_model.bin"}, names
    assert_adapter_only(tmp_path / "state", model)
    size = sum(f.stat().st_size for f in (tmp_path / "state" / "causal_adapter").iterdir())
    assert size < base_bytes(model) / 5
    # more steps change the adapter and the optimizer; load_state brings both back exactly
    pmodel(**batch).loss.backward()
    opt.step()
    assert not torch.equal(adapter_tensors(model)["action.b_cls"], saved["action.b_cls"])
    acc.load_state(str(tmp_path / "state"))
    assert_same_tensors(adapter_tensors(model), saved)
    for k, v in opt_state.items():
        assert torch.equal(opt.state_dict()["state"][0][k], v)
    # strict: a state directory without the adapter, or an adapter of another shape, is refused
    os.rename(tmp_path / "state" / "causal_adapter", tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match="has no causal adapter"):
        acc.load_state(str(tmp_path / "state"))
    other = tiny_model(tie=tie, lora=lora, threshold_mode="vector", learnable_threshold=True)
    other.save_pretrained(tmp_path / "state" / "causal_adapter")
    with pytest.raises(ValueError, match="thresholds.*has shape"):
        acc.load_state(str(tmp_path / "state"))


# ============================================================================ peft
def trained(model, steps=3):
    opt = torch.optim.Adam([p for _, p in model.trainable_parameters()], lr=2e-2)
    batch = NumericCollator(0)(toy_rows(8))
    for _ in range(steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    return model


@pytest.fixture(scope="module")
def local_base_dir(tmp_path_factory):
    """A tiny untied base saved as a local checkpoint: loadable by name/path offline (as a hub name would be)."""
    d = tmp_path_factory.mktemp("base") / "tiny-qwen3"
    tiny_base("qwen3").save_pretrained(d)
    return d


def ids_batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 280, (2, 9), generator=g)


def test_peft_loaders_read_the_lora_part_and_never_meet_our_schema(tmp_path, local_base_dir):
    from peft import AutoPeftModelForCausalLM, LoraConfig, PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    frozen = trained(tiny_model())
    frozen.save_pretrained(tmp_path / "frozen")
    assert not (tmp_path / "frozen" / LEGACY_CONFIG_NAME).exists()  # nothing under peft's name
    with pytest.raises(ValueError, match="adapter_config.json"):
        PeftConfig.from_pretrained(str(tmp_path / "frozen"))

    base = AutoModelForCausalLM.from_pretrained(local_base_dir)
    model = trained(get_causal_model(base, CausalAdapterConfig(num_token_id=NUM, lora=LORA)))
    model.save_pretrained(tmp_path / "lora")
    cfg = PeftConfig.from_pretrained(str(tmp_path / "lora"))
    assert isinstance(cfg, LoraConfig) and cfg.r == 4 and set(cfg.target_modules) == {"q_proj", "v_proj"}
    assert cfg.base_model_name_or_path == str(local_base_dir)
    ids = ids_batch()
    with torch.no_grad():
        want = model.backbone(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(local_base_dir), str(tmp_path / "lora"))
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want)
        auto = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "lora"))
        torch.testing.assert_close(auto(input_ids=ids).logits, want)
        plain = AutoModelForCausalLM.from_pretrained(local_base_dir)(input_ids=ids).logits
        assert not torch.allclose(plain, want)  # the LoRA did change the backbone
    # our own loader reads our files (LoRA included) from the same directory
    again = CausalModel.from_pretrained(AutoModelForCausalLM.from_pretrained(local_base_dir), tmp_path / "lora")
    assert_same_tensors(adapter_tensors(again), adapter_tensors(model))


def test_legacy_directories_with_peft_file_names_still_load(tmp_path):
    model = trained(tiny_model(lora=LORA))
    model.save_pretrained(tmp_path / "a")
    # that layout held every adapter tensor, LoRA included, in the one weights file
    from causal_adapter.saving.artifacts import write_adapter_files

    both = tmp_path / "both"
    both.mkdir()
    write_adapter_files(both, json.loads((tmp_path / "a" / CONFIG_NAME).read_text()), model.adapter_state_dict())
    old = tmp_path / "old"
    old.mkdir()
    (old / LEGACY_CONFIG_NAME).write_bytes((both / CONFIG_NAME).read_bytes())
    (old / LEGACY_WEIGHTS_NAME).write_bytes((both / WEIGHTS_NAME).read_bytes())
    loaded = CausalModel.from_pretrained(tiny_base(), old)
    assert_same_tensors(adapter_tensors(loaded), adapter_tensors(model))
    # a real peft adapter directory is named as such, not misread
    os.remove(tmp_path / "a" / CONFIG_NAME)
    with pytest.raises(FileNotFoundError, match="holds a peft LORA adapter, not a causal_adapter one"):
        CausalModel.from_pretrained(tiny_base(), tmp_path / "a")


def test_merge_and_unload_unload_and_disable_adapter():
    from peft.tuners.tuners_utils import BaseTunerLayer

    ids = ids_batch()
    vals = torch.zeros(ids.shape)
    model = trained(tiny_model(lora=LORA)).eval()
    with torch.no_grad():
        before = model(ids, vals, return_scores=True)
        base_out = tiny_base()(input_ids=ids, output_hidden_states=True)
        with model.disable_adapter():
            torch.testing.assert_close(model.backbone(input_ids=ids).logits, base_out.logits, rtol=0, atol=0)
            torch.testing.assert_close(model(ids, vals).hidden_states, base_out.hidden_states[-1], rtol=0, atol=0)
        torch.testing.assert_close(model(ids, vals).loc_Y, before.loc_Y, rtol=0, atol=0)  # re-enabled
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    merged = model.merge_and_unload()
    assert merged is model and model.causal_config.lora is None
    assert not any(isinstance(m, BaseTunerLayer) for m in model.backbone.modules())
    with torch.no_grad():
        after = model(ids, vals, return_scores=True)
    for name in ("loc_U", "scale_U", "loc_Y", "scale_Y", "loc_S", "scale_S"):
        torch.testing.assert_close(getattr(after, name), getattr(before, name), rtol=1e-4, atol=1e-4)
    assert not [n for n, p in model.backbone.named_parameters() if p.requires_grad]

    unloaded = trained(tiny_model(lora=LORA)).unload()
    with torch.no_grad():
        torch.testing.assert_close(unloaded.backbone(input_ids=ids).logits, base_out.logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="frozen backbone.*no LoRA to merge"):
        tiny_model().merge_and_unload()
    with tiny_model().disable_adapter():  # no LoRA: the backbone is the base already
        pass


# ============================================================================ from_pretrained / hub / card
def test_from_pretrained_like_peft(tmp_path, local_base_dir):
    from transformers import AutoModelForCausalLM

    model = trained(get_causal_model(AutoModelForCausalLM.from_pretrained(local_base_dir),
                                     CausalAdapterConfig(num_token_id=NUM, lora=LORA)))
    model.save_pretrained(tmp_path / "a", metrics={"eval_loss": 1.25, "num_mae": 0.5})
    # inference by default: eval mode, nothing requires grad
    m = CausalModel.from_pretrained(tiny_base("qwen3"), tmp_path / "a")
    assert not m.training and not [n for n, p in m.named_parameters() if p.requires_grad]
    t = CausalModel.from_pretrained(tiny_base("qwen3"), tmp_path / "a", is_trainable=True)
    assert t.training and {n for n, _ in t.trainable_parameters()} == {n for n, _ in model.trainable_parameters()}
    # the base by local path / hub-style name, or None (the base recorded in the adapter), with a dtype
    by_path = CausalModel.from_pretrained(str(local_base_dir), tmp_path / "a", torch_dtype=torch.bfloat16)
    assert by_path.W_cls.dtype == torch.bfloat16 and by_path.action.b_cls.dtype == torch.float32
    by_record = CausalModel.from_pretrained(None, tmp_path / "a", device_map="cpu")
    assert_same_tensors(adapter_tensors(by_record), adapter_tensors(model))
    cast = CausalModel.from_pretrained(tiny_base("qwen3"), tmp_path / "a", dtype="float64")
    assert cast.W_cls.dtype == torch.float64
    with pytest.raises(OSError, match="cannot load the base model 'nobody/no-such-base'"):
        CausalModel.from_pretrained("nobody/no-such-base", tmp_path / "a")
    # the model card names the base, the configuration and the metrics
    card = (tmp_path / "a" / "README.md").read_text()
    assert f"base_model: {local_base_dir}" in card and '"r": 4' in card and "| validation | L = L_cls + lambda L_reg | 1.25 |" in card


def test_hub_ids_fail_fast_and_clearly_offline(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    t0 = time.perf_counter()
    with pytest.raises(OSError) as e:
        CausalModel.from_pretrained(tiny_base(), "someone/causal-adapter-x")
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    assert "\n" not in msg and "someone/causal-adapter-x" in msg and "offline" in msg
    with pytest.raises(OSError, match=r"^cannot push to 'me/x': the Hugging Face Hub is offline"):
        tiny_model().push_to_hub("me/x")
    # a path that does not exist and is no repo id keeps the local-directory error
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CausalModel.from_pretrained(tiny_base(), tmp_path / "missing")


# ============================================================================ generate
def test_generate_accepts_generation_config_and_length_penalty_arguments():
    from transformers import GenerationConfig

    model = trained(tiny_model()).eval()
    ids = ids_batch()[:1]
    ref = model.generate(input_ids=ids, max_new_tokens=5, eos_token_id=[])
    first = int(ref.new_tokens[0, 0])
    via_config = model.generate(input_ids=ids, generation_config=GenerationConfig(max_new_tokens=5, eos_token_id=[]))
    assert torch.equal(via_config.sequences, ref.sequences)
    # sampling fields of a GenerationConfig do not apply to the deterministic mode (the mode chooses)
    sampled_cfg = GenerationConfig(max_new_tokens=5, do_sample=True, temperature=0.7, top_p=0.8, num_beams=1)
    assert torch.equal(model.generate(input_ids=ids, generation_config=sampled_cfg, eos_token_id=[]).sequences,
                       ref.sequences)
    assert torch.equal(model.generate(input_ids=ids, max_length=ids.shape[1] + 5, eos_token_id=[]).sequences,
                       ref.sequences)
    # eos lists and min_new_tokens: the first token as eos stops at once, unless min_new_tokens forbids it
    stop = model.generate(input_ids=ids, max_new_tokens=5, eos_token_id=[first, 7])
    assert stop.lengths.tolist() == [1] and stop.finished.all()
    for mode in ("deterministic", "causal", "softmax"):
        kw = {"seed": 0} if mode == "causal" else {}
        out = model.generate(input_ids=ids, mode=mode, max_new_tokens=5, eos_token_id=[first, 7], min_new_tokens=3, **kw)
        assert out.lengths[0] >= 3 and not set(out.new_tokens[0, :2].tolist()) & {first, 7}, mode
    # repetition_penalty (softmax): no word of the prompt or of the new text comes back; <NUM> is exempt
    # (every number shares that token)
    rep = model.generate(input_ids=ids, mode="softmax", max_new_tokens=6, eos_token_id=[], repetition_penalty=1e6)
    new = [t for t in rep.new_tokens[0].tolist() if t != NUM]
    assert len(set(new)) == len(new) and not set(new) & set(ids[0].tolist())
    # what a mode cannot honour is refused with the list of what it accepts
    with pytest.raises(ValueError, match=r"repetition_penalty applies to mode='softmax'.*accepts \[.*max_length"):
        model.generate(input_ids=ids, repetition_penalty=1.2)
    with pytest.raises(ValueError, match=r"does not support \['num_beams'\].*accepts \[.*min_new_tokens"):
        model.generate(input_ids=ids, num_beams=4)
    with pytest.raises(ValueError, match=r"generation_config sets \['num_beams'\]"):
        model.generate(input_ids=ids, generation_config=GenerationConfig(num_beams=4))
    model.generate(input_ids=ids, max_new_tokens=2, num_beams=1, use_cache=True)  # neutral values pass
    with pytest.raises(ValueError, match="max_length=3 leaves no room"):
        model.generate(input_ids=ids, max_length=3)


def test_text_streamer_gets_the_numbers(qwen_tokenizer, capsys):
    from transformers import TextIteratorStreamer, TextStreamer

    from causal_adapter.saving.assets import build_tiny_qwen

    tok = qwen_tokenizer
    model = get_causal_model(build_tiny_qwen("qwen2", hidden_size=32, num_layers=1), tokenizer=tok).eval()
    with torch.no_grad():
        model.action.b_cls[model.num_token_id] = 1e4  # <NUM> wins every step: numbers only
    out = model.generate("Values: 3 and 4.5 then", tokenizer=tok, max_new_tokens=3, eos_token_id=[],
                         streamer=TextStreamer(tok, skip_prompt=True))
    printed = capsys.readouterr().out
    assert out.new_tokens[0].tolist() == [model.num_token_id] * 3
    assert printed == out.texts[0] + "\n" and any(c.isdigit() for c in printed)
    it = TextIteratorStreamer(tok, skip_prompt=True)
    model.generate("Values: 3 and 4.5 then", tokenizer=tok, max_new_tokens=3, eos_token_id=[], streamer=it)
    assert "".join(it) == out.texts[0]


# ============================================================================ train() on a stream
def test_train_on_a_streaming_dataset_with_exact_resume(tmp_path):
    import datasets

    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import train

    rows = toy_rows(40)

    def stream():
        return datasets.IterableDataset.from_generator(lambda: iter(rows))

    def cfg(out, **kw):
        return TrainConfig(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                           logging_steps=1, plot=False, progress=False, cpu=True, seed=0, **kw)

    full = train(tiny_model(), cfg(tmp_path / "full"), train_dataset=stream())
    assert full.global_step == 4 and full.train_loss == full.train_loss
    part = train(tiny_model(), cfg(tmp_path / "part", save_steps=2), train_dataset=stream())
    resumed = train(tiny_model(), cfg(tmp_path / "part", save_steps=2,
                                      resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2")),
                    train_dataset=stream())
    assert resumed.resumed_from is not None and part.global_step == 4
    assert_same_tensors(adapter_tensors(resumed.model), adapter_tensors(full.model))
    with pytest.raises(ValueError, match="streaming train_dataset.*set max_steps > 0"):
        train(tiny_model(), TrainConfig(output_dir=str(tmp_path / "x"), cpu=True, plot=False, progress=False),
              train_dataset=stream())


# ============================================================================ FSDP2 on CPU (2 gloo processes)
FSDP_SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from safetensors.torch import save_file
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from causal_adapter import CausalAdapterConfig, get_causal_model
from causal_adapter.saving.assets import build_tiny_qwen
from causal_adapter.data.pipeline import NumericCollator
from causal_adapter.saving.fsdp import fully_shard_causal_model, full_adapter_state_dict, save_fsdp_adapter
out = sys.argv[1]
base = build_tiny_qwen("qwen2", vocab_size=320, hidden_size=32, num_layers=2)
model = fully_shard_causal_model(get_causal_model(base, CausalAdapterConfig(num_token_id=300)))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
g = torch.Generator().manual_seed(0)
rows = []
for _ in range(8):
    ids = torch.randint(0, 280, (10,), generator=g)
    vals = torch.zeros(10)
    ids[5] = 300
    vals[5] = float(ids[0] % 7) + 0.5
    rows.append({"input_ids": ids.tolist(), "numeric_values": vals.tolist(), "labels": ids.tolist()})
batch = NumericCollator(0)(rows[rank * 4:(rank + 1) * 4])
losses = []
for step in range(8):
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    l = loss.detach().clone()
    dist.all_reduce(l)
    losses.append(l.item() / world)
full = full_adapter_state_dict(model)
save_file({k: v.contiguous() for k, v in full.items()}, f"{out}/full_rank{rank}.safetensors")
save_fsdp_adapter(model, f"{out}/adapter")
sharded = [n for n, p in model.named_parameters() if type(p).__name__ == "DTensor"]
if rank == 0:
    with open(f"{out}/result.json", "w") as f:
        json.dump({"losses": losses, "world": world, "sharded": sharded}, f)
dist.destroy_process_group()
from causal_adapter.saving.process_groups import exit_without_teardown
exit_without_teardown()  # no teardown to race gloo's threads (docs/distributed.md, "Exit")
"""


def test_fsdp2_on_cpu_two_gloo_processes_frozen_base_trainable_heads(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "fsdp_run.py"
    script.write_text(FSDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(port), str(script), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launcher and both workers (their own session)
        raise
    assert proc.returncode == 0, err[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    # the decoder layers are sharded; the heads stay replicated (ignored), their gradients averaged
    assert res["world"] == 2 and any(".layers.0." in n for n in res["sharded"]), res["sharded"]
    assert not any(n.startswith(("action.", "abduction.", "numeric_embedding.")) for n in res["sharded"])
    assert res["losses"][-1] < res["losses"][0] - 0.01, res["losses"]
    a, b = (load_file(str(tmp_path / f"full_rank{r}.safetensors")) for r in (0, 1))
    assert_same_tensors(a, b)  # the replicas agree
    loaded = CausalModel.from_pretrained(tiny_base(), tmp_path / "adapter")
    assert_same_tensors(adapter_tensors(loaded), a)
    assert_adapter_only(tmp_path / "adapter", loaded)


def test_saving_into_a_shared_directory_replaces_only_our_files(tmp_path):
    from causal_adapter.saving.adapter_io import save_adapter_into

    d = tmp_path / "out"
    (d / "checkpoint-1").mkdir(parents=True)
    (d / "notes.txt").write_text("mine")
    lora = trained(tiny_model(lora=LORA))
    save_adapter_into(lora, d)
    assert (d / "adapter_config.json").is_file() and (d / "notes.txt").read_text() == "mine"
    frozen = trained(tiny_model())
    save_adapter_into(frozen, d)  # no LoRA now: the stale peft view goes, the rest stays
    assert not (d / "adapter_config.json").exists() and not (d / "adapter_model.safetensors").exists()
    assert (d / "checkpoint-1").is_dir() and (d / "notes.txt").read_text() == "mine"
    assert_same_tensors(adapter_tensors(CausalModel.from_pretrained(tiny_base(), d)), adapter_tensors(frozen))


def test_saving_into_a_checkpoint_other_processes_write_keeps_their_files(tmp_path):
    """CausalTrainer under FSDP: the main process saves the adapter into checkpoint-N while every process writes
    its model shard there (Trainer's save_fsdp_model). The directory is never replaced as a whole, empty or not:
    a swap lost another process's shard directory (seen: FileNotFoundError on rank 1, 1 run in 30)."""
    from causal_adapter.saving.adapter_io import save_adapter_into

    model, checkpoint = trained(tiny_model(lora=LORA)), tmp_path / "checkpoint-4"
    checkpoint.mkdir()  # Trainer's makedirs: empty when the main process starts saving
    save_pretrained = model.save_pretrained

    def save_while_another_process_writes(directory, **kwargs):
        shard = checkpoint / "pytorch_model_fsdp_0" / "__1_0.distcp"
        shard.parent.mkdir(exist_ok=True)
        shard.write_bytes(b"rank 1")
        return save_pretrained(directory, **kwargs)

    model.save_pretrained = save_while_another_process_writes
    inode = checkpoint.stat().st_ino
    save_adapter_into(model, checkpoint)
    assert (checkpoint / "pytorch_model_fsdp_0" / "__1_0.distcp").read_bytes() == b"rank 1"
    assert checkpoint.stat().st_ino == inode
    assert_same_tensors(adapter_tensors(CausalModel.from_pretrained(tiny_base(), checkpoint)), adapter_tensors(model))
