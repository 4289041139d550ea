"""Several adapters on one base (peft's names): each adapter, active, gives exactly what it gives loaded alone;
switching back and forth changes nothing; the base is held once."""
from __future__ import annotations

import pytest
import torch

from causal_adapter import CausalAdapterConfig, CausalModel, LoraSettings, get_causal_model
from conftest import small_vocab_qwen

NUM = 300  # a row of the small vocabulary no test text uses


def _trained(tmp_path, name, *, lora=None, seed=0, value_loc=10.0):
    """An adapter made distinct by a few Adam steps on random rows, saved under tmp_path/name."""
    model = get_causal_model(small_vocab_qwen(), CausalAdapterConfig(
        num_token_id=NUM, lora=lora, seed=seed, learnable_direction=True, learnable_threshold=True,
        value_loc=value_loc, value_scale=2.0 + seed))
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 280, (3, 9), generator=g)
    ids[:, 4] = NUM
    vals = torch.zeros(3, 9)
    vals[:, 4] = torch.tensor([3.5, -2.0, 11.0])
    opt = torch.optim.Adam([p for _, p in model.trainable_parameters()], lr=3e-2)
    for _ in range(3):
        opt.zero_grad()
        model(ids, vals, labels=ids).loss.backward()
        opt.step()
    return model.save_pretrained(tmp_path / name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {"frozen": _trained(d, "frozen", seed=0),
            "lora": _trained(d, "lora", lora=LoraSettings(r=4), seed=1, value_loc=-5.0),
            "lora2": _trained(d, "lora2", lora=LoraSettings(r=2, target_modules=("q_proj", "v_proj")), seed=2)}


def _inputs():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 280, (2, 11), generator=g)
    ids[0, 3], ids[1, 6] = NUM, NUM
    vals = torch.zeros(2, 11)
    vals[0, 3], vals[1, 6] = 4.25, -13.0
    return ids, vals


def _outputs(model):
    ids, vals = _inputs()
    with torch.no_grad():
        o = model(ids, vals, labels=ids, return_scores=True)
    out = {k: getattr(o, k) for k in ("loss", "loc_U", "scale_U", "loc_Y", "scale_Y", "loc_S", "scale_S")}
    out["generated"] = model.generate(ids, max_new_tokens=5, mode="deterministic").sequences
    return out


def _alone(path):
    return CausalModel.from_pretrained(small_vocab_qwen(), path)


def _assert_bitwise(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_each_adapter_active_equals_it_loaded_alone_bit_for_bit(saved):
    alone = {name: _outputs(_alone(path)) for name, path in saved.items()}
    model = CausalModel.from_pretrained(small_vocab_qwen(), saved["frozen"], adapter_name="frozen")
    model.load_adapter(saved["lora"], "lora")
    model.load_adapter(saved["lora2"], "lora2")
    assert model.adapter_names == ["frozen", "lora", "lora2"] and model.active_adapter == "frozen"
    assert not any(p.requires_grad for p in model.parameters())  # loaded for inference, like peft
    _assert_bitwise(_outputs(model), alone["frozen"])  # loading others changed nothing
    for name in ("lora", "frozen", "lora2", "lora", "lora2", "frozen"):  # back and forth
        model.set_adapter(name)
        assert model.active_adapter == name and model.causal_config.value_loc == _alone(saved[name]).causal_config.value_loc
        _assert_bitwise(_outputs(model), alone[name])
    # the adapters really differ (else the equalities above prove nothing)
    assert not torch.equal(alone["frozen"]["loc_Y"], alone["lora"]["loc_Y"])
    assert not torch.equal(alone["lora"]["loc_S"], alone["lora2"]["loc_S"])


def test_saving_the_active_adapter_writes_its_own_files(saved, tmp_path):
    model = CausalModel.from_pretrained(small_vocab_qwen(), saved["frozen"], adapter_name="frozen")
    model.load_adapter(saved["lora"], "lora")
    model.set_adapter("lora")
    again = model.save_pretrained(tmp_path / "again")
    _assert_bitwise(_outputs(_alone(again)), _outputs(_alone(saved["lora"])))
    assert (again / "adapter_model.safetensors").is_file()  # peft's LoRA files come with it


def test_delete_and_errors_leave_the_model_as_it_was(saved, tmp_path):
    model = CausalModel.from_pretrained(small_vocab_qwen(), saved["lora"], adapter_name="lora")
    model.load_adapter(saved["frozen"], "frozen")
    reference = _outputs(model)
    with pytest.raises(ValueError, match="already loaded"):
        model.load_adapter(saved["lora2"], "frozen")
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        model.set_adapter("nope")
    with pytest.raises(ValueError, match="adapter name"):
        model.load_adapter(saved["lora2"], "a.b")
    other = get_causal_model(small_vocab_qwen(hidden_size=48), CausalAdapterConfig(num_token_id=NUM))
    with pytest.raises(ValueError, match="hidden_size"):
        model.load_adapter(other.save_pretrained(tmp_path / "wide"), "wide")
    assert model.adapter_names == ["lora", "frozen"]
    _assert_bitwise(_outputs(model), reference)

    model.load_adapter(saved["lora2"], "lora2")
    lora_params = sum(p.numel() for n, p in model.backbone.named_parameters() if "lora_" in n)
    model.delete_adapter("lora2")
    assert model.adapter_names == ["lora", "frozen"]
    assert not any(".lora2." in n for n, _ in model.named_parameters())
    assert sum(p.numel() for n, p in model.backbone.named_parameters() if "lora_" in n) < lora_params
    _assert_bitwise(_outputs(model), reference)
    model.delete_adapter("lora")  # the active one: the next loaded becomes active
    assert model.adapter_names == ["frozen"] and model.active_adapter == "frozen"
    _assert_bitwise(_outputs(model), _outputs(_alone(saved["frozen"])))
    with pytest.raises(ValueError, match="only adapter"):
        model.delete_adapter("frozen")


def test_the_base_is_held_once(saved):
    base = small_vocab_qwen()
    base_params = sum(p.numel() for p in base.parameters())
    model = CausalModel.from_pretrained(base, saved["lora2"], adapter_name="lora2")
    # a LoRA with the family's default targets joins a backbone whose Linears peft already wrapped
    for name in ("lora", "frozen"):
        model.load_adapter(saved[name], name)
    sizes = {name: sum(p.numel() for p in _alone(path).parameters()) - base_params for name, path in saved.items()}
    assert sum(p.numel() for p in model.parameters()) == base_params + sum(sizes.values())
    model.set_adapter("lora")
    _assert_bitwise(_outputs(model), _outputs(_alone(saved["lora"])))


def test_parked_adapters_move_with_the_model_and_train_only_when_active(saved):
    model = CausalModel.from_pretrained(small_vocab_qwen(), saved["frozen"], adapter_name="frozen", is_trainable=True)
    model.load_adapter(saved["lora"], "lora", is_trainable=True)
    trainable = {n for n, _ in model.trainable_parameters()}
    assert trainable and not any(n.startswith("parked_adapters.") or "lora_" in n for n in trainable)
    model.to(torch.float64)
    model.set_adapter("lora")
    assert model.action.b_cls.dtype == torch.float64 and model.numeric_embedding.direction.dtype == torch.float64
    names = {n for n, _ in model.trainable_parameters()}
    assert any("lora_A.lora." in n for n in names) and not any(n.startswith("parked_adapters.") for n in names)
    model.set_adapter("frozen")
    assert {n for n, _ in model.trainable_parameters()} == trainable


@pytest.mark.parametrize("mode", ["deterministic", "softmax", "causal"])
def test_a_batch_of_several_adapters_gives_each_row_its_own_adapters_output(saved, mode):
    """peft's mixed batch (`generate(..., adapter_names=...)`): one backbone pass for all rows, each row with its
    own adapter's embedding, heads and LoRA; a row gets what its adapter gives it in a batch of its own."""
    model = CausalModel.from_pretrained(small_vocab_qwen(), saved["frozen"], adapter_name="frozen")
    model.load_adapter(saved["lora"], "lora")
    model.load_adapter(saved["lora2"], "lora2")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 280, (6, 8), generator=g)
    ids[:, 5] = NUM
    vals = torch.zeros(6, 8)
    vals[:, 5] = torch.tensor([1.5, -4.0, 9.0, 0.25, 30.0, -2.5])
    names = ["lora", "frozen", "lora2", "frozen", "lora", "lora2"]
    kw = dict(max_new_tokens=6, mode=mode, eos_token_id=[], seed=11 if mode == "causal" else None,
              shared_individual=mode == "causal")
    mixed = model.generate(ids, numeric_values=vals, adapter_names=names, **kw)
    assert model.active_adapter == "frozen"  # restored
    for a in ("frozen", "lora", "lora2"):
        rows = [i for i, n in enumerate(names) if n == a]
        model.set_adapter(a)
        alone = model.generate(ids[rows], numeric_values=vals[rows], **kw)
        assert torch.equal(mixed.new_tokens[rows], alone.new_tokens), a
        torch.testing.assert_close(mixed.new_values[rows], alone.new_values, rtol=1e-5, atol=1e-5)
        for r, row_numbers in zip(rows, alone.numbers):
            assert [n["position"] for n in mixed.numbers[r]] == [n["position"] for n in row_numbers]
    model.set_adapter("frozen")
    # the rows really differ by adapter (else equal outputs would prove nothing)
    same = model.generate(ids, numeric_values=vals, **kw)
    assert not torch.equal(same.new_tokens, mixed.new_tokens) or not torch.allclose(same.new_values, mixed.new_values)
    with pytest.raises(ValueError, match="not loaded"):
        model.generate(ids, numeric_values=vals, adapter_names=["nope"] * 6, **kw)


def test_generate_batched_mixes_adapters_with_text_prompts(saved, qwen_tokenizer):
    from causal_adapter.saving.assets import build_tiny_qwen

    tok = qwen_tokenizer
    base = build_tiny_qwen("qwen2", seed=0)
    paths = {}
    for i, name in enumerate(("a", "b")):
        m = get_causal_model(base, CausalAdapterConfig(seed=i, value_loc=50.0, value_scale=10.0 + i), tokenizer=tok)
        with torch.no_grad():
            m.abduction.loc.weight.add_(0.5 * torch.randn(m.abduction.loc.weight.shape,
                                                         generator=torch.Generator().manual_seed(i)))
        paths[name] = m.save_pretrained(saved["frozen"].parent / f"text_{name}")
    model = CausalModel.from_pretrained(build_tiny_qwen("qwen2", seed=0), paths["a"], tokenizer=tok, adapter_name="a")
    model.load_adapter(paths["b"], "b", tokenizer=tok)
    prompts = ["Sunspots 1749: 80.9, 1750: 83.4, 1751:", "Nile 1871: 1120, 1872:", "x", "2, 4, 8,"]
    names = ["a", "b", "b", "a"]
    mixed = model.generate_batched(prompts, tok, batch_size=4, adapter_names=names, max_new_tokens=6)
    texts = {}
    for a in ("a", "b"):
        model.set_adapter(a)
        texts[a] = [o.texts[0] for o in model.generate_batched(prompts, tok, batch_size=4, max_new_tokens=6)]
    assert sum(x != y for x, y in zip(texts["a"], texts["b"])) >= 2  # the adapters write different texts
    for a in ("a", "b"):
        model.set_adapter(a)
        own = [p for p, n in zip(prompts, names) if n == a]
        alone = model.generate_batched(own, tok, batch_size=1, max_new_tokens=6)
        assert [o.texts[0] for o in alone] == [o.texts[0] for o, n in zip(mixed, names) if n == a]


def test_disable_adapter_runs_the_base_backbone_under_the_active_heads(saved):
    model = CausalModel.from_pretrained(small_vocab_qwen(), saved["frozen"], adapter_name="frozen")
    model.load_adapter(saved["lora"], "lora")
    ids = torch.randint(0, 280, (2, 9), generator=torch.Generator().manual_seed(5))  # no <NUM>: phi is 0 for both
    with torch.no_grad():
        base_z = model(ids).hidden_states  # "frozen" active: the backbone is the base
        model.set_adapter("lora")
        lora_z = model(ids).hidden_states
        with model.disable_adapter():
            off = model(ids)
    assert not torch.equal(lora_z, base_z)
    assert torch.equal(off.hidden_states, base_z)
    assert model.causal_configs["lora"].value_loc == model.causal_config.value_loc != model.causal_configs["frozen"].value_loc
