"""The step loop (`modeling.generation.loop.StepLoop`, docs/decoding.md): rows join a running batch at any step and leave it
when they finish; every row gets what it gets alone (`generate` on its prompt alone with its adapter): the same
tokens, values to float rounding. Random arrival orders, mixed lengths, mixed adapters (frozen and LoRA: peft's mixed
batch), mixed modes, eos, a prefix cache; a sliding-window cache (rows cannot be left padded) falls back to one batch
at a time. `generate` runs on the same loop, so rows are also checked against references that share none of it:
an uncached recomputation, and transformers' own `generate` at initialisation. Real transformers / peft classes,
tiny float64 models."""
from __future__ import annotations

import random

import pytest
import torch

from causal_adapter import CausalAdapterConfig, CausalModel, LoraSettings, get_causal_model
from causal_adapter.modeling.generation import generate
from causal_adapter.modeling.generation.cache import PrefixCache
from causal_adapter.modeling.generation.loop import StepLoop
from causal_adapter.modeling.generation.options import decoding_options
from causal_adapter.modeling.generation.prepare import Group
from causal_adapter.modeling.generation.record import Row
from conftest import small_vocab_qwen
from test_generation import one_thread, perturb, stir  # noqa: F401 (one_thread: tiny models run on one thread)
from test_generation import reference_generate

NUM = 300
ADAPTERS = ("frozen", "lora", "lora2")


def _base():
    return stir(small_vocab_qwen(dtype=torch.float64, seed=4), seed=4, std=0.3)  # layers that matter


def _adapter(tmp_path, name, *, lora=None, seed=0, num_bias=0.0):
    """A distinct adapter (noisy heads, LoRA factors made non-zero, its own value units and recent numbers), saved."""
    model = get_causal_model(_base(), CausalAdapterConfig(num_token_id=NUM, lora=lora, seed=seed, value_loc=10.0 * seed, gamma0=0.3, threshold_init=0.0,
                                                          value_scale=3.0, recent_values=2 * seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.backbone.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    perturb(model, seed=seed, num_bias=num_bias, b_reg=0.0)
    return model.save_pretrained(tmp_path / name)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("loop")
    paths = {"frozen": _adapter(d, "frozen", seed=0), "lora": _adapter(d, "lora", lora=LoraSettings(r=4), seed=1, num_bias=2.0),
             "lora2": _adapter(d, "lora2", lora=LoraSettings(r=2, target_modules=("q_proj", "v_proj")), seed=2)}
    m = CausalModel.from_pretrained(_base(), paths["frozen"], adapter_name="frozen")
    for name in ADAPTERS[1:]:
        m.load_adapter(paths[name], name)
    return m


def _requests(model, seed: int, n: int = 12):
    """n requests: (prompt ids, values, adapter, mode, max_new_tokens, eos ids), prompts of 2 to 13 tokens; every
    third one stops on an eos id: the token it writes second alone."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        L = rng.randint(2, 13)
        ids = [rng.randrange(280) for _ in range(L)]
        vals = [0.0] * L
        if L > 3:
            ids[2], vals[2] = NUM, round(rng.uniform(-50, 50), 2)
        request = (ids, vals, rng.choice(ADAPTERS), rng.choice(("deterministic", "softmax")), rng.randint(2, 9), [])
        if i % 3 == 0:
            request = request[:5] + ([int(_alone(model, request).new_tokens[0, 1])],)
        out.append(request)
    return out


def _alone(model, request):
    ids, vals, adapter, mode, k, eos = request
    model.set_adapter(adapter)
    try:
        return generate(model, torch.tensor([ids]), numeric_values=torch.tensor([vals], dtype=torch.float64),
                        mode=mode, max_new_tokens=k, eos_token_id=eos)
    finally:
        model.set_adapter("frozen")


def _groups(requests):
    """One Group per (adapter, mode, eos), as the server keys them."""
    groups = {}
    for _, _, adapter, mode, _, eos in requests:
        key = (adapter, mode, tuple(eos))
        if key not in groups:
            opts = decoding_options(mode, None, {}, None, False, False, dict.fromkeys(
                ("max_new_tokens", "max_length", "min_new_tokens", "pad_token_id", "stop_strings", "do_sample",
                 "temperature", "top_k", "top_p", "repetition_penalty")) | {"eos_token_id": eos})
            groups[key] = Group(adapter, opts, None, values_dtype=torch.float64)
    return groups


def _run_arrivals(model, requests, arrival_steps, max_rows, prefix=None):
    """The requests joining a StepLoop at the given steps; returns (rows in request order, batch sizes seen)."""
    groups = _groups(requests)
    rows = [Row(ids, vals, groups[(a, m, tuple(e))], k, tag=i) for i, (ids, vals, a, m, k, e) in enumerate(requests)]
    loop = StepLoop(model, max_rows=max_rows, prefix_cache=prefix)
    step, sizes = 0, []
    pending = sorted(range(len(rows)), key=lambda i: arrival_steps[i])
    with torch.no_grad():
        while pending or loop.busy:
            while pending and arrival_steps[pending[0]] <= step:
                loop.add([rows[pending.pop(0)]])
            loop.step()
            sizes.append(len(loop.rows))
            if loop.rows:
                assert loop.cache.layers[0].keys.shape[0] == len(loop.rows) == loop.mask.shape[0]
                assert loop.cache.layers[0].keys.shape[-2] == loop.mask.shape[1]
                assert bool(loop.mask[:, 0].any())  # the padding no row needs is cut
            step += 1
    assert loop.cache is None and not loop.rows  # every row left and freed its cache
    return rows, sizes


def _assert_alone(model, requests, rows):
    for request, row in zip(requests, rows):
        alone = _alone(model, request)
        n = int(alone.lengths[0])
        assert row.tokens == alone.new_tokens[0, :n].tolist(), request
        assert row.finished == bool(alone.finished[0])
        torch.testing.assert_close(torch.tensor(row.fed_values, dtype=torch.float64), alone.new_values[0, :n],
                                   rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(torch.tensor(row.probs, dtype=torch.float64), alone.token_probs[0, :n],
                                   rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("schedule", [0, 1, 2])
def test_rows_joining_at_random_steps_get_what_they_get_alone(model, schedule):
    requests = _requests(model, schedule)
    rng = random.Random(100 + schedule)
    arrivals = [rng.randint(0, 6) for _ in requests]
    rows, sizes = _run_arrivals(model, requests, arrivals, max_rows=4)
    assert max(sizes) == 4 and len(set(sizes)) > 2  # full at times (rows waited), rows joining and leaving
    assert any(NUM in r.tokens for r in rows) and any(r.finished for r in rows)  # numbers written, eos hit
    assert len({r.group.adapter for r in rows}) == 3
    _assert_alone(model, requests, rows)


def test_a_prefix_read_from_the_prefix_cache_gives_the_same_rows(model):
    """Rows that begin the same way (a shared 16-token head) read it from the prefix cache instead of recomputing it;
    each row still gets what it gets alone."""
    rng = random.Random(7)
    head = [rng.randrange(280) for _ in range(19)]
    head[5] = NUM
    requests = [(head + [rng.randrange(280) for _ in range(rng.randint(1, 6))], [0.0] * 5 + [4.5] + [0.0] * 30,
                 a, "deterministic", 5, []) for a in ("frozen", "lora", "frozen", "lora", "frozen")]
    requests = [(ids, vals[:len(ids)], a, m, k, e) for ids, vals, a, m, k, e in requests]
    prefix = PrefixCache(block=8)
    rows, _ = _run_arrivals(model, requests, [0, 0, 2, 3, 3], max_rows=8, prefix=prefix)
    assert [r.reused_tokens for r in rows] == [0, 0, 16, 16, 16]  # two whole blocks of 8, per adapter
    assert prefix.hit_tokens == 48
    _assert_alone(model, requests, rows)


def test_a_row_differing_in_the_last_token_of_a_block_reuses_only_the_blocks_before_it(model):
    """A block's key holds every token id and value up to its end: prompts that differ only in the last token of
    their second block of 8 (its id, the values equal; or the value of the <NUM> there) read the first block alone
    from the cache; the same 16 tokens with another tail read both. Each row still gets what it gets alone."""
    rng = random.Random(11)
    head = [rng.randrange(280) for _ in range(16)]
    head[10] = NUM  # in both blocks' keys the adapter counts from block 2 on, whatever token 15 is
    vals = [0.0] * 10 + [2.5] + [0.0] * 5
    other = head[:15] + [(head[15] + 1) % 280]
    numbered = head[:15] + [NUM]
    tail = [17, 23, 5]
    prompts = [(head + tail, vals + [0.0] * 3),  # stores its two blocks
               (numbered + tail, vals[:15] + [4.5, 0.0, 0.0, 0.0]),  # stores its second block (another last token)
               (other + tail, vals + [0.0] * 3),  # another id at position 15, the same values
               (numbered + tail, vals[:15] + [-7.25, 0.0, 0.0, 0.0]),  # the same ids, the <NUM>'s value differs
               (head + [9, 41], vals + [0.0] * 2)]  # the same 16 tokens: both blocks
    requests = [(ids, v, "lora", "deterministic", 4, []) for ids, v in prompts]
    prefix = PrefixCache(block=8)
    rows, _ = _run_arrivals(model, requests, [0, 0, 2, 2, 3], max_rows=8, prefix=prefix)
    assert [r.reused_tokens for r in rows] == [0, 0, 8, 8, 16]
    _assert_alone(model, requests, rows)


def _assert_recomputed(model, requests, rows):
    """Each row equals `reference_generate` on its prompt (a full forward over the growing sequence at every step, the
    heads written out): the same tokens, as many, and the same values fed back."""
    for (ids, vals, adapter, mode, k, eos), row in zip(requests, rows):
        model.set_adapter(adapter)
        try:
            want, want_vals = reference_generate(model, torch.tensor([ids]), torch.tensor([vals], dtype=torch.float64),
                                                 torch.ones(1, len(ids), dtype=torch.long), mode, k, eos=eos)
        finally:
            model.set_adapter("frozen")
        assert row.tokens == want[0].tolist(), (ids, adapter, mode, k, eos)
        assert row.finished == (bool(eos) and want[0, -1].item() in eos)
        torch.testing.assert_close(torch.tensor(row.fed_values, dtype=torch.float64), want_vals[0], rtol=1e-9,
                                   atol=1e-9)


@pytest.mark.parametrize("schedule", [0, 1])
def test_rows_joining_at_random_steps_equal_a_full_recomputation(model, schedule):
    """The step loop against a reference that shares none of its code (`generate` runs on the same loop): every row,
    whatever the rows beside it, writes what an uncached recomputation writes, up to its max_new_tokens or its eos."""
    requests = _requests(model, 10 + schedule)
    rng = random.Random(200 + schedule)
    rows, _ = _run_arrivals(model, requests, [rng.randint(0, 6) for _ in requests], max_rows=4)
    assert any(r.finished for r in rows) and any(not r.finished for r in rows)
    _assert_recomputed(model, requests, rows)


def test_rows_of_an_adapter_at_initialisation_equal_transformers_greedy_generate():
    """At initialisation the softmax mode is the base model's greedy decoding: rows joining a running batch at random
    steps write exactly what transformers' own `generate` writes for each prompt alone, as many tokens (max_new_tokens,
    or up to an eos id)."""
    import copy

    base = _base()
    m = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM))
    rng = random.Random(3)
    gc = copy.deepcopy(base.generation_config)
    gc.do_sample, gc.pad_token_id = False, 0
    requests, wants = [], []
    for i in range(8):
        ids = [rng.randrange(280) for _ in range(rng.randint(2, 13))]
        k = rng.randint(2, 12)
        gc.max_new_tokens, gc.eos_token_id = k, None
        with torch.no_grad():
            free = base.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 generation_config=gc)[0, len(ids):].tolist()
        eos = [free[1]] if i % 3 == 0 else []  # a row that stops at the id it writes second
        want = free[:free.index(eos[0]) + 1] if eos else free
        requests.append((ids, [0.0] * len(ids), None, "softmax", k, eos))
        wants.append(want)
    groups = _groups(requests)
    rows = [Row(ids, vals, groups[(a, md, tuple(e))], k) for ids, vals, a, md, k, e in requests]
    loop = StepLoop(m, max_rows=3)
    arrivals = [rng.randint(0, 5) for _ in rows]
    step = 0
    with torch.no_grad():
        while step <= 5 or loop.busy:
            loop.add([r for r, t in zip(rows, arrivals) if t == step])
            loop.step()
            step += 1
            assert step < 200
    for (ids, *_rest), row, want in zip(requests, rows, wants):
        assert row.tokens == want, ids
    assert any(len(w) > 6 for w in wants) and any(r.finished for r in rows)


def test_a_cache_that_cannot_be_left_padded_runs_one_batch_at_a_time():
    """A sliding-window cache (DynamicSlidingWindowLayer) cannot take rows of other lengths: rows join when the batch
    is empty and leave together, and each still gets what it gets alone."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                      sliding_window=5, max_window_layers=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = transformers.Qwen2ForCausalLM(config).to(torch.float64).eval()
    m = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM))
    rng = random.Random(5)
    requests = [([rng.randrange(280) for _ in range(rng.randint(2, 9))], None, None, "deterministic", rng.randint(2, 7),
                 []) for _ in range(6)]
    requests = [(ids, [0.0] * len(ids), *rest) for ids, _, *rest in requests]
    groups = _groups(requests)
    rows = [Row(ids, vals, groups[(None, "deterministic", ())], k) for ids, vals, _, _, k, _ in requests]
    loop = StepLoop(m, max_rows=4)
    loop.add(rows[:3])
    with torch.no_grad():
        loop.step()
        assert loop.fixed_reason is not None and "DynamicSlidingWindowLayer" in loop.fixed_reason
        loop.add(rows[3:])
        joined_late = []
        while loop.busy:
            loop.step()
            joined_late.append(rows[3] in loop.rows and any(r in loop.rows for r in rows[:3]))
    assert not any(joined_late)  # never together: the second batch waited for the first to end
    for (ids, vals, *_rest), row in zip(requests, rows):
        k = _rest[-2]
        alone = generate(m, torch.tensor([ids]), numeric_values=torch.tensor([vals], dtype=torch.float64),
                         max_new_tokens=k, eos_token_id=[])
        assert row.tokens == alone.new_tokens[0].tolist()


def test_a_fork_of_one_prefill_gets_what_each_row_gets_alone_and_takes_one_row(model):
    """`StepLoop.add(rows, fork=True)`: the rows of one prompt (a horizon's lanes) join a running batch from ONE
    prefill (`cache.fork_rows`); each writes what it writes alone, and the fork takes one row of max_rows (lane 0)."""
    requests = _requests(model, 7, n=3)
    groups = _groups(requests)
    others = [Row(ids, vals, groups[(a, m, tuple(e))], k) for ids, vals, a, m, k, e in requests[:2]]
    ids, vals, a, m, k, e = requests[2]
    lanes = [Row(ids, vals, groups[(a, m, tuple(e))], k, lane=i) for i in range(4)]
    loop = StepLoop(model, max_rows=2)
    loop.add(others[:1])
    sizes = []
    with torch.no_grad():
        loop.step()
        loop.add(lanes, fork=True)
        loop.add(others[1:])
        while loop.busy:
            loop.step()
            sizes.append(len(loop.rows))
    assert loop.prefills == 3 and max(sizes) == 5  # one prefill for the 4 lanes; 1 row + the fork (one row of 2)
    _assert_alone(model, requests[:2], others)
    _assert_alone(model, [requests[2]] * 4, lanes)


def test_forced_tokens_are_written_and_a_lane_stops_after_its_values(model):
    """A row's `forced` tokens (a horizon's continuation): a given (id, value) is written as given, (<NUM>, None) with
    the value head's value at that position (deterministic mode: loc_Y, as an uncached forward gives it); a row with
    `max_values` is done after that many values, one whose values come after `value_after` counts only those, and
    one that writes `max_text` tokens without a value ends saying so. Given tokens after a step's own go through the
    backbone with it in one pass (`record.with_given_run`)."""
    ids, vals = _requests(model, 3, n=1)[0][:2]
    a = "lora2"  # its value head reads 4 recent numbers: a given <NUM> (4.5) enters the window
    g = _groups([(ids, vals, a, "deterministic", 9, [])])[(a, "deterministic", ())]  # no eos: the lengths are ours
    forced = [(17, 0.0), (NUM, 4.5), (23, 0.0), (NUM, None), (29, 0.0), (NUM, None), (31, 0.0)]
    full, short = Row(ids, vals, g, 9, forced=forced, max_values=2), Row(ids, vals, g, 9, forced=forced, max_values=1)
    loop = StepLoop(model)
    loop.add([full, short])
    with torch.no_grad():
        while loop.busy:
            loop.step()
            if loop.rows:  # the value head's window holds the given numbers too
                assert loop.recent.shape[1] == 4
                torch.testing.assert_close(loop.recent, loop._windows(loop.rows, 4), equal_nan=True)
    assert full.tokens == [t for t, _ in forced[:6]] and full.value_steps == [3, 5]
    assert short.tokens == [t for t, _ in forced[:4]] and short.value_steps == [3]
    assert full.fed_values[1] == 4.5 and full.fed_values[0] == full.fed_values[2] == 0.0
    model.set_adapter(a)
    try:
        for at in (3, 5):
            seq = ids + full.tokens[:at]
            seq_vals = vals + full.fed_values[:at]
            with torch.no_grad():
                ref = model(torch.tensor([seq]), torch.tensor([seq_vals], dtype=torch.float64))
            assert full.loc_Y[at] == pytest.approx(float(ref.loc_Y[0, -1]), rel=1e-9)
            assert full.exact[at] == pytest.approx(float(model.value_map.to_value(ref.loc_Y[0, -1])), rel=1e-9)
    finally:
        model.set_adapter("frozen")
    # values only after the two tokens (23, <NUM>): the <NUM> at 1 is text; none within 2 tokens it writes: it ends
    text = Row(ids, vals, g, 9, forced=forced, max_values=9, value_after=(23, NUM), max_text=8)
    quiet = Row(ids, vals, g, 9, max_values=1, value_after=(23, NUM), max_text=2)
    loop.add([text, quiet])
    with torch.no_grad():
        while loop.busy:
            loop.step()
    assert text.value_steps == [3, 5] and len(text.tokens) == 9
    assert len(quiet.tokens) == 3 and not quiet.value_steps and "wrote no value within 2 tokens" in quiet.stop_reason
