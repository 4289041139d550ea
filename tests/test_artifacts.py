"""Adapter-only save / load: content, exact reload, compatibility checks, atomicity."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from causal_adapter import CausalAdapterConfig, CausalModel, LoraSettings, get_causal_model
from causal_adapter.saving.artifacts import CONFIG_NAME, WEIGHTS_NAME
from causal_adapter.saving.assets import build_tiny_qwen
from causal_adapter.training.value_head.warm_start import fit_depth

NUM = 151_669


def trained_model(arch="qwen2", lora=None, seed=0, steps=3, **cfg):
    """A model after a few optimiser steps, so that every adapter tensor differs from its init."""
    base = build_tiny_qwen(arch, seed=seed)
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM, lora=lora, learnable_threshold=True,
                                                       threshold_mode="vector", learnable_direction=True, **cfg))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 150_000, (2, 8), generator=g)
    ids[:, 3] = NUM
    vals = torch.zeros(2, 8)
    vals[:, 3] = torch.tensor([12.5, -7.0])
    optimise(model, ids, vals, steps)
    return model, ids, vals


def optimise(model, ids, vals, steps):
    """`steps` Adam steps (lr 1e-2) of the model's loss on (ids, vals), labels = ids."""
    opt = torch.optim.Adam([p for _, p in model.trainable_parameters()], lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(ids, vals, labels=ids).loss.backward()
        opt.step()


def outputs(model, ids, vals):
    with torch.no_grad():
        o = model(ids, vals, labels=ids, return_scores=True)
    return [o.loss, o.loc_U, o.scale_U, o.loc_Y, o.scale_Y, o.loc_S, o.scale_S]


@pytest.mark.parametrize("arch, lora", [("qwen2", None), ("qwen3", LoraSettings(r=4, target_modules=["q_proj", "v_proj"]))])
def test_save_reload_identical_outputs(tmp_path, arch, lora):
    model, ids, vals = trained_model(arch, lora=lora)
    # the per-row scale's fitted statistics (set by the value head's fit, not by gradient steps)
    C = model.action.w_reg.shape[0]
    feats = torch.randn(40, C, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    model.action.set_depth(fit_depth(feats, model.action.depth_basis.shape[0]))
    model.action.log_scale_range.copy_(torch.tensor([-1.0, 1.0]))
    init = get_causal_model(build_tiny_qwen(arch, seed=0), model.causal_config)
    for name, t in model.adapter_state_dict().items():  # every adapter tensor was trained
        if name not in ("numeric_embedding.direction",) and t.dtype.is_floating_point:
            assert not torch.equal(t, init.adapter_state_dict()[name]), name
    model.save_pretrained(tmp_path / "adapter")
    extra = ["adapter_config.json", "adapter_model.safetensors"] if lora is not None else []  # peft's LoRA files
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME, "README.md"] + extra)
    fresh_base = build_tiny_qwen(arch, seed=0)
    loaded = CausalModel.from_pretrained(fresh_base, tmp_path / "adapter")
    for a, b in zip(outputs(model, ids, vals), outputs(loaded, ids, vals)):
        assert torch.equal(a, b)
    if lora is not None:  # LoRA in peft's file, once
        assert any("lora_A" in k for k in load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
        assert not any("lora_A" in k for k in load_file(str(tmp_path / "adapter" / WEIGHTS_NAME)))


def test_saved_file_holds_only_adapter_tensors(tmp_path):
    model, _, _ = trained_model("qwen2", lora=LoraSettings(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "a")
    tensors = load_file(str(tmp_path / "a" / WEIGHTS_NAME))
    V, H = 151_936, 64
    heads = {"numeric_embedding.direction", "abduction.loc.weight", "abduction.loc.bias", "abduction.scale.weight",
             "abduction.scale.bias", "action.b_noise", "action.b_cls", "action.thresholds", "action.num_row",
             "action.w_reg", "action.b_reg", "action.b_noise_Y", "action.w_scale_Y", "action.depth_mean",
             "action.depth_basis", "action.depth_weight", "action.depth_resid", "action.depth_ref",
             "action.log_scale_range"}
    assert heads <= set(tensors)
    assert set(tensors) == heads  # the LoRA tensors are in peft's file only
    peft = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert peft and all("lora_A" in k or "lora_B" in k for k in peft)
    for k, t in tensors.items():
        if k in ("action.b_cls", "action.thresholds"):
            assert t.shape == (V,)
        else:
            assert V not in t.shape, k  # never a vocabulary-sized matrix
    assert tensors["action.num_row"].shape == (H,)
    meta = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    assert meta["num_token_id"] == NUM and meta["vocab_size"] == V and meta["hidden_size"] == H
    assert meta["model_type"] == "qwen2" and meta["adapter_config"]["lora"]["r"] == 2
    assert meta["library_version"] and meta["format_version"] == 1


def test_reload_in_a_new_process(tmp_path):
    model, ids, vals = trained_model("qwen3")
    model.save_pretrained(tmp_path / "a")
    torch.save({"ids": ids, "vals": vals, "loc_Y": outputs(model, ids, vals)[3]}, tmp_path / "ref.pt")
    code = textwrap.dedent(f"""
        import torch
        from causal_adapter import CausalModel
        from causal_adapter.saving.assets import build_tiny_qwen
        ref = torch.load({str(tmp_path / 'ref.pt')!r})
        m = CausalModel.from_pretrained(build_tiny_qwen("qwen3", seed=0), {str(tmp_path / 'a')!r})
        with torch.no_grad():
            y = m(ref["ids"], ref["vals"]).loc_Y
        assert torch.equal(y, ref["loc_Y"]), (y - ref["loc_Y"]).abs().max()
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]


def test_incompatible_base_is_refused_naming_both_sides(tmp_path, qwen_tokenizer):
    model, _, _ = trained_model("qwen2")
    model.save_pretrained(tmp_path / "a")
    with pytest.raises(ValueError, match="model_type='qwen2'.*model_type='qwen3'"):
        CausalModel.from_pretrained(build_tiny_qwen("qwen3"), tmp_path / "a")
    with pytest.raises(ValueError, match="hidden_size=64.*hidden_size=32"):
        CausalModel.from_pretrained(build_tiny_qwen("qwen2", hidden_size=32), tmp_path / "a")
    with pytest.raises(ValueError, match="vocab_size=151936.*vocab_size=152000"):
        CausalModel.from_pretrained(build_tiny_qwen("qwen2", vocab_size=152_000), tmp_path / "a")
    # a Qwen2.5 tokenizer would put <NUM> at 151,665: simulate by a tokenizer of another length
    class ShortTokenizer:
        def __len__(self):
            return 151_665

    with pytest.raises(ValueError, match="num_token_id=151669.*len\\(tokenizer\\)=151665"):
        CausalModel.from_pretrained(build_tiny_qwen("qwen2"), tmp_path / "a", tokenizer=ShortTokenizer())
    # the real tokenizer agrees
    CausalModel.from_pretrained(build_tiny_qwen("qwen2"), tmp_path / "a", tokenizer=qwen_tokenizer)


def test_damaged_artifacts_give_clear_errors(tmp_path):
    model, _, _ = trained_model("qwen2", steps=1)
    d = tmp_path / "a"
    model.save_pretrained(d)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CausalModel.from_pretrained(build_tiny_qwen(), tmp_path / "nope")
    w = d / WEIGHTS_NAME
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        CausalModel.from_pretrained(build_tiny_qwen(), d)
    w.write_bytes(data)
    meta = json.loads((d / CONFIG_NAME).read_text())
    (d / CONFIG_NAME).write_text(json.dumps({**meta, "format_version": 99, "library_version": "9.0"}))
    with pytest.raises(ValueError, match="format_version=99.*upgrade causal_adapter"):
        CausalModel.from_pretrained(build_tiny_qwen(), d)
    (d / CONFIG_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="adapter_config.json.*is missing"):
        CausalModel.from_pretrained(build_tiny_qwen(), d)


def test_adapter_of_another_configuration_is_refused(tmp_path):
    model, _, _ = trained_model("qwen2", steps=1)
    model.save_pretrained(tmp_path / "a")
    plain = get_causal_model(build_tiny_qwen(), CausalAdapterConfig(num_token_id=NUM))  # no vector thresholds
    from causal_adapter.saving.artifacts import read_adapter_files

    _, tensors = read_adapter_files(tmp_path / "a")
    with pytest.raises(ValueError, match="thresholds.*has shape"):
        plain.load_adapter_state_dict(tensors)
    tensors["action.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unexpected \\['action.extra'\\]"):
        plain.load_adapter_state_dict(tensors)


def test_crash_during_save_leaves_previous_adapter(tmp_path, monkeypatch):
    model, ids, vals = trained_model("qwen2", steps=1)
    d = tmp_path / "a"
    model.save_pretrained(d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    import causal_adapter.saving.adapter_io as model_module

    def crash(directory, config, tensors):  # the new weights file is half written, then the process dies
        (directory / WEIGHTS_NAME).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_module, "write_adapter_files", crash)
    with torch.no_grad():
        model.action.b_reg.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(d)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # the temporary directory was cleaned up
    CausalModel.from_pretrained(build_tiny_qwen(), d)


def _fork_saver(model, versions, directory, ready, rounds=None):
    """A forked child that saves alternating adapter versions to `directory` (until killed)."""
    import multiprocessing as mp

    def run():
        i = 0
        while rounds is None or i < rounds:
            model.load_adapter_state_dict(versions[i % len(versions)])
            model.save_pretrained(directory)
            if i == 0:
                ready.set()
            i += 1
        os._exit(0)

    proc = mp.get_context("fork").Process(target=run)
    proc.start()
    return proc


def _version_of(directory, versions):
    from causal_adapter.saving.artifacts import read_adapter_files

    _, tensors = read_adapter_files(directory)
    for i, v in enumerate(versions):
        if set(v) == set(tensors) and all(torch.equal(v[k], tensors[k]) for k in v):
            return i
    return None


def _two_versions():
    from conftest import small_vocab_qwen

    model = get_causal_model(small_vocab_qwen(), CausalAdapterConfig(num_token_id=300))
    v0 = {k: t.clone() for k, t in model.adapter_state_dict().items()}
    v1 = {k: (t + 1.0 if t.dtype.is_floating_point else t).clone() for k, t in v0.items()}
    return model, [v0, v1]


def test_kill_9_during_save_never_damages_the_adapter(tmp_path):
    """SIGKILL a process that saves in a loop, at random moments, many times: the directory
    always holds one complete version, which loads."""
    import multiprocessing as mp
    import random
    import signal
    import time

    model, versions = _two_versions()
    d = tmp_path / "adapter"
    model.load_adapter_state_dict(versions[0])
    model.save_pretrained(d)
    rng = random.Random(0)
    seen = set()
    kills = 25
    for _ in range(kills):
        ready = mp.get_context("fork").Event()
        proc = _fork_saver(model, versions, d, ready)
        ready.wait(30)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        v = _version_of(d, versions)
        assert v is not None, "the adapter directory holds a mix of versions"
        seen.add(v)
    assert seen == {0, 1}  # the kills really landed at different points of the save loop
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "adapter"]
    model.save_pretrained(d)  # the next save removes temporary directories of killed writers
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"], leftovers
    from conftest import small_vocab_qwen

    CausalModel.from_pretrained(small_vocab_qwen(), d)


def test_concurrent_saves_give_one_complete_adapter(tmp_path):
    import multiprocessing as mp

    model, versions = _two_versions()
    d = tmp_path / "adapter"
    events = [mp.get_context("fork").Event() for _ in range(2)]
    procs = [_fork_saver(model, [versions[i]], d, events[i], rounds=15) for i in range(2)]
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert _version_of(d, versions) in (0, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_model_card_usage_runs_as_written_offline(tmp_path):
    """The card's Usage snippet, executed verbatim in a fresh offline process from the directory the adapter
    was saved from, loads the adapter onto the embedded default base (rebuilt locally: no hub lookup)."""
    import re
    import subprocess
    import sys

    from causal_adapter import get_causal_model
    from causal_adapter.saving.assets import build_tiny_qwen

    model = get_causal_model(build_tiny_qwen("qwen2"), CausalAdapterConfig(num_token_id=NUM))
    fresh_count = model.get_nb_trainable_parameters()[0]
    model.requires_grad_(False)  # as after a run that froze parts: the card keeps the adapter's size as built
    model.save_pretrained(tmp_path / "adapter", metrics={"eval_tokens": 7, "eval_value_mae": 1.5, "train_loss": 2.0})
    card = (tmp_path / "adapter" / "README.md").read_text()
    snippet = re.search(r"## Usage\n\n```python\n(.*?)```", card, re.S).group(1)
    assert "'causal-adapter/tiny-qwen2-h64-l2-seed0'" in snippet and "huggingface.co/causal-adapter" not in card
    assert f"adapter parameters: {fresh_count:,d} trainable" in card
    assert "| validation | tokens scored | 7 |" in card and "eval_eval" not in card and "| train |" in card
    code = snippet + "\nprint(type(model).__name__, model.num_token_id)\n"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # any hub call would fail
    out = subprocess.run([sys.executable, "-c", code.replace(str(tmp_path / "adapter"), "adapter")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["CausalModel", str(model.num_token_id)]


def test_from_pretrained_none_uses_the_recorded_embedded_base(tmp_path):
    from causal_adapter import CausalModel, get_causal_model
    from causal_adapter.saving.assets import build_tiny_qwen

    model = get_causal_model(build_tiny_qwen("qwen3", hidden_size=32, num_layers=1, seed=3),
                             CausalAdapterConfig(num_token_id=NUM))
    model.save_pretrained(tmp_path)
    again = CausalModel.from_pretrained(None, tmp_path)
    assert again.backbone.name_or_path == "causal-adapter/tiny-qwen3-h32-l1-seed3"
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).loc_Y, model(ids).loc_Y)


def test_lora_tensors_are_stored_once_and_old_directories_still_load(tmp_path):
    """save_pretrained keeps the LoRA tensors in peft's adapter_model.safetensors only; a directory of an
    earlier version (LoRA in our file as well) loads to the same model."""
    from safetensors.torch import load_file

    from causal_adapter.saving.artifacts import write_adapter_files
    from causal_adapter.saving.peft_lora import LORA_PREFIX, PEFT_WEIGHTS_NAME

    model, ids, vals = trained_model("qwen2", lora=LoraSettings(r=2, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path / "new")
    ours, peft = load_file(tmp_path / "new" / WEIGHTS_NAME), load_file(tmp_path / "new" / PEFT_WEIGHTS_NAME)
    lora = {k: v for k, v in model.adapter_state_dict().items() if k.startswith(LORA_PREFIX)}
    assert lora and peft and not any(k.startswith(LORA_PREFIX) or "lora_" in k for k in ours)
    assert len(peft) == len(lora)
    reloaded = CausalModel.from_pretrained(build_tiny_qwen("qwen2"), tmp_path / "new")
    for a, b in zip(outputs(model, ids, vals), outputs(reloaded, ids, vals)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the old layout: every tensor in our file too (peft's file beside it, as before)
    import shutil

    shutil.copytree(tmp_path / "new", tmp_path / "old")
    meta = json.loads((tmp_path / "old" / CONFIG_NAME).read_text())
    write_adapter_files(tmp_path / "old", meta, {**ours, **{k: v + 0.0 for k, v in lora.items()}})
    (tmp_path / "old" / PEFT_WEIGHTS_NAME).unlink()  # the old layout did not need it to load
    old = CausalModel.from_pretrained(build_tiny_qwen("qwen2"), tmp_path / "old")
    for a, b in zip(outputs(model, ids, vals), outputs(old, ids, vals)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    (tmp_path / "new" / PEFT_WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        CausalModel.from_pretrained(build_tiny_qwen("qwen2"), tmp_path / "new")
