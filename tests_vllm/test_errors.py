"""Bad inputs fail at export or at load with a message that names the problem (the load checks are the code vLLM's
model class runs in its constructor: `heads_loader.load_heads`)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch


from causal_adapter.commands.main import main
from causal_adapter.integrations.vllm.folder import HEADS_DIR
from causal_adapter.integrations.vllm.heads_loader import load_heads


def test_a_missing_heads_file_fails_at_load(toy, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(toy / "out", out, symlinks=True)
    (out / HEADS_DIR / "causal_adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="causal_adapter_model.safetensors' is missing"):
        load_heads(out, torch.float32, "cpu")


def test_an_adapter_of_another_base_fails(toy, tmp_path, capsys):
    from causal_adapter.saving.assets import build_tiny_qwen

    other = tmp_path / "other"
    build_tiny_qwen("qwen2", hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1).save_pretrained(other)
    assert main(["export-vllm", str(toy / "run" / "adapter"), str(tmp_path / "o1"), "--base", str(other)]) == 1
    assert "was made for hidden_size=256, but the base model has hidden_size=128" in capsys.readouterr().err
    # a folder whose config.json was swapped for another base's after the export: refused when vLLM loads it
    out = tmp_path / "o2"
    shutil.copytree(toy / "out", out, symlinks=True)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="was made for hidden_size=256"):
        load_heads(out, torch.float32, "cpu")


def test_a_family_without_a_class_fails(toy, tmp_path, capsys):
    adapter = tmp_path / "adapter"
    shutil.copytree(toy / "run" / "adapter", adapter)
    meta = json.loads((adapter / "causal_adapter_config.json").read_text())
    (adapter / "causal_adapter_config.json").write_text(json.dumps({**meta, "model_type": "qwen3_next"}))
    assert main(["export-vllm", str(adapter), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "the vLLM plugin has classes for the qwen2 and qwen3 families; this adapter's base is 'qwen3_next'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2


def test_a_lora_on_expert_parameters_fails(toy, tmp_path, capsys):
    """A LoRA adapter exports (test_lora.py), but not a LoRA on fused MoE expert parameters (peft's
    target_parameters), which the export's peft folder does not carry."""
    adapter = tmp_path / "adapter"
    shutil.copytree(toy / "run" / "adapter", adapter)
    meta = json.loads((adapter / "causal_adapter_config.json").read_text())
    lora = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj"]}
    meta["adapter_config"]["lora"] = lora
    (adapter / "causal_adapter_config.json").write_text(json.dumps(meta))
    assert main(["export-vllm", str(adapter), str(tmp_path / "o")]) == 1
    assert "LoRA is on fused expert parameters ['mlp.experts.gate_up_proj']" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_folder_links_the_base(toy):
    out, base = toy / "out", toy / "base"
    assert (out / "model.safetensors").is_symlink()
    assert (out / "model.safetensors").resolve() == (base / "model.safetensors").resolve()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["CausalAdapterQwen2ForCausalLM"]
    assert sorted(p.name for p in (out / HEADS_DIR).iterdir()) == ["causal_adapter_config.json",
                                                                   "causal_adapter_model.safetensors"]
