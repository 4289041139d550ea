"""Generation (SPEC 4): base equivalence, KV cache vs full recomputation, the three modes,
<NUM> value feedback, stopping, streaming. Every check compares with an independent computation."""
import io
import math

import pytest
import torch

from causal_adapter import CausalAdapterConfig, get_causal_model
from causal_adapter.saving.assets import build_tiny_qwen
from causal_adapter.modeling.generation import GenerationOutput, NumberStreamer, generate
from causal_adapter.numbers import NumberTokenizer, find_numbers, format_number
from causal_adapter.modeling.scoring import OvRScorer
from conftest import small_vocab_qwen

NUM_SMALL = 300  # <NUM> row of the small-vocabulary models (vocab 320)
NUM_REAL = 151_669  # len(Qwen3 tokenizer): first reserved row of the real vocabulary
PAD_REAL = 151_643


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread is faster, and with the cores shared by other work a second
    thread mostly waits at the barrier of every small op."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tok(qwen_tokenizer):
    return qwen_tokenizer


@pytest.fixture(scope="module")
def bases():
    """Real-vocabulary tiny Qwens (layers stirred), built once; tests wrap them with fresh heads."""
    return {
        "qwen2": stir(build_tiny_qwen("qwen2", hidden_size=32, seed=3), seed=1, std=0.1),
        "qwen3": stir(build_tiny_qwen("qwen3", hidden_size=32, seed=3), seed=1, std=0.1),
        "qwen2_f64": stir(build_tiny_qwen("qwen2", hidden_size=32, seed=9, dtype=torch.float64), seed=9),
    }


def stir(base, seed=0, std=0.15):
    """Random tiny Qwens barely use their layers (std 0.02): make the layers matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in base.model.layers.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std)
    return base


def perturb(model, seed=0, num_bias=0.0, b_reg=40.0):
    """Trained-looking heads: uneven scale_U, noisy b_cls, a <NUM> bias, values around b_reg."""
    g = torch.Generator().manual_seed(seed)
    a, act = model.abduction, model.action

    def noise(t, std):
        return torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype) * std

    with torch.no_grad():
        a.scale.weight.add_(noise(a.scale.weight, 0.05))
        act.b_cls.add_(noise(act.b_cls, 0.5))
        act.b_cls[model.num_token_id] += num_bias
        act.b_reg.fill_(b_reg)
    return model


def small_model(num_bias=0.0, gamma0=1.0, seed=0):
    base = stir(small_vocab_qwen(dtype=torch.float64, hidden_size=32, seed=seed), seed=seed)
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM_SMALL, gamma0=gamma0))
    return perturb(model, seed=seed, num_bias=num_bias)


def small_prompts():
    """Two left-padded prompts of lengths 7 and 4, with numbers in them."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 290, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    vals = torch.zeros(2, 7, dtype=torch.float64)
    ids[0, 2], vals[0, 2] = NUM_SMALL, 99.9
    ids[1, 5], vals[1, 5] = NUM_SMALL, -3.5
    return ids, vals, mask


def positions(mask):
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def effective_W(model):
    W = model.W_cls.detach().to(model.action.b_cls.dtype).clone()
    if model.action.num_row is not None:
        W[model.num_token_id] = model.action.num_row
    return W


@torch.no_grad()
def reference_generate(model, ids, vals, mask, mode, steps, *, eos=(), pad=0, seed=None, shared=False,
                       top_k=None, temperature=None):
    """Uncached: a full forward over the whole growing sequence at every step, heads written out."""
    act = model.action
    W, C = effective_W(model), act.thresholds
    B = ids.shape[0]
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    H = W.shape[1]
    shared_eps = torch.rand((B, H), generator=gen, dtype=W.dtype) if (mode == "causal" and shared) else None
    finished = torch.zeros(B, dtype=torch.bool)
    new_ids, new_vals = [], []
    for _ in range(steps):
        out = model(ids, vals, attention_mask=mask, position_ids=positions(mask), return_scores=True)
        loc_S, scale_S = out.loc_S[:, -1], out.scale_S[:, -1]
        loc_U, scale_Up = out.loc_U[:, -1], act.noisy_scale(out.scale_U[:, -1])
        if mode == "softmax":
            if top_k is None:
                tok = loc_S.argmax(-1)
            else:
                s = loc_S / temperature
                kth = s.topk(top_k, -1).values[:, -1:]
                probs = torch.softmax(s.masked_fill(s < kth, -math.inf), -1)
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            val = out.loc_Y[:, -1]
        elif mode == "deterministic":
            P = 0.5 + torch.atan((loc_S - C) / scale_S) / math.pi
            tok, val = P.argmax(-1), out.loc_Y[:, -1]
        else:
            eps = shared_eps if shared else torch.rand((B, H), generator=gen, dtype=W.dtype)
            u = loc_U + scale_Up * torch.tan(math.pi * (eps - 0.5))
            tok = (u @ W.T + act.b_cls - C).argmax(-1)
            # the head's own Cauchy at the quantile u gives it: w_reg . (u - loc_U) / (|w_reg| . scale_U') is an
            # exact standard Cauchy deviate (the first coordinate's deviate where w_reg = 0)
            dev = u - loc_U
            den = scale_Up @ act.w_reg.abs()
            t = torch.where(den > 0, (dev @ act.w_reg) / den, torch.tan(math.pi * (eps[:, 0] - 0.5)))
            val = out.loc_Y[:, -1] + out.scale_Y[:, -1] * t
        tok = torch.where(finished, pad, tok)
        val = torch.where(tok == model.num_token_id, val, 0.0)
        finished = finished | torch.isin(tok, torch.tensor(list(eos), dtype=torch.long))
        new_ids.append(tok)
        new_vals.append(val)
        ids = torch.cat([ids, tok[:, None]], 1)
        vals = torch.cat([vals, val[:, None].to(vals.dtype)], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if finished.all():
            break
    return torch.stack(new_ids, 1), torch.stack(new_vals, 1)


# --------------------------------------------------------------------------- softmax == base
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_softmax_greedy_equals_base_generate(arch, tok, bases):
    import copy

    base = bases[arch]
    assert base.config.tie_word_embeddings == (arch == "qwen2")
    model = get_causal_model(base, CausalAdapterConfig(), tokenizer=tok)
    enc = NumberTokenizer(tok)(["Hello there, how are", "The cat sat on the mat and then it", "x"],
                               padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert (mask == 0).any()
    T = 12
    gc = copy.deepcopy(base.generation_config)
    gc.eos_token_id, gc.do_sample, gc.max_new_tokens = None, False, T  # no eos on either side
    ref = base.generate(ids, attention_mask=mask, generation_config=gc)
    out = model.generate(input_ids=ids, attention_mask=mask, mode="softmax", max_new_tokens=T, eos_token_id=[])
    assert isinstance(out, GenerationOutput)
    assert torch.equal(out.sequences, ref)
    assert len(set(ref[:, -T:].flatten().tolist())) > 8  # a real sequence, not one repeated token

    # with an eos that one row reaches mid-way: same early stop and padding as transformers
    eos = int(ref[0, -T + 4])
    ref2 = base.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=T, eos_token_id=eos,
                         pad_token_id=PAD_REAL)
    out2 = model.generate(input_ids=ids, attention_mask=mask, mode="softmax", max_new_tokens=T, eos_token_id=eos)
    assert torch.equal(out2.sequences, ref2)
    stop = (ref[0, -T:] == eos).nonzero()[0, 0].item() + 1
    assert out2.lengths[0].item() == stop and out2.finished[0].item()
    assert (out2.new_tokens[0, stop:] == PAD_REAL).all() and (out2.new_values == 0).all()
    assert out2.attention_mask[0, ids.shape[1] + stop:].sum() == 0


# --------------------------------------------------------------------------- cache == recomputation
@pytest.mark.parametrize("mode,kw,num_bias", [
    ("softmax", {}, 1.5),
    ("softmax", dict(top_k=20, temperature=0.7, seed=3), 3.0),
    ("deterministic", {}, 8.0),
    ("causal", dict(seed=11), 2.0),
    ("causal", dict(seed=12, shared_individual=True), 1.5),
])
def test_cached_equals_uncached_recomputation(mode, kw, num_bias):
    model = small_model(num_bias=num_bias)
    ids, vals, mask = small_prompts()
    T = 10
    out = model.generate(input_ids=ids, numeric_values=vals, attention_mask=mask, mode=mode, max_new_tokens=T,
                         eos_token_id=[], **kw)
    ref_ids, ref_vals = reference_generate(model, ids, vals, mask, mode, T, seed=kw.get("seed"),
                                           shared=kw.get("shared_individual", False), top_k=kw.get("top_k"),
                                           temperature=kw.get("temperature"))
    assert torch.equal(out.new_tokens, ref_ids)
    torch.testing.assert_close(out.new_values, ref_vals, rtol=0, atol=1e-5)
    # the test exercises value feedback: generated <NUM>s whose values differ
    is_num = out.new_tokens == NUM_SMALL
    assert is_num.sum() >= 2 and len(set(out.new_values[is_num].tolist())) == int(is_num.sum())
    assert (out.new_values[~is_num] == 0).all()
    assert torch.equal(out.sequences[:, :7], ids) and torch.equal(out.numeric_values[:, :7], vals)


def test_cached_equals_uncached_with_eos():
    model = small_model(num_bias=2.0)
    ids, vals, mask = small_prompts()
    free, _ = reference_generate(model, ids, vals, mask, "causal", 8, seed=4)
    eos = int(free[1, 2])  # row 1 stops at its third token
    out = model.generate(input_ids=ids, numeric_values=vals, attention_mask=mask, mode="causal", max_new_tokens=8,
                         eos_token_id=eos, pad_token_id=7, seed=4)
    ref_ids, ref_vals = reference_generate(model, ids, vals, mask, "causal", 8, eos=[eos], pad=7, seed=4)
    assert torch.equal(out.new_tokens, ref_ids)
    torch.testing.assert_close(out.new_values, ref_vals, rtol=0, atol=1e-5)
    k = (free[1] == eos).nonzero()[0, 0].item()
    assert out.lengths[1].item() == k + 1 and (out.new_tokens[1, k + 1:] == 7).all()


# --------------------------------------------------------------------------- deterministic = argmax P
@pytest.mark.parametrize("perturbed", [False, True])
def test_deterministic_picks_argmax_of_full_forward_P(perturbed, tok, bases):
    base = bases["qwen3"]
    model = get_causal_model(base, CausalAdapterConfig(gamma0=3.0), tokenizer=tok)
    if perturbed:
        perturb(model, seed=6)
    ntok = NumberTokenizer(tok)
    enc = ntok(["In 1749 the sunspot number was 80.9", "Price: 99.9 yuan"], padding_side="left")
    T = 6
    out = model.generate(enc, mode="deterministic", max_new_tokens=T, eos_token_id=[])
    unpruned = model.generate(enc, mode="deterministic", max_new_tokens=T, eos_token_id=[], ovr_pruning=False)
    assert torch.equal(out.sequences, unpruned.sequences)
    S = enc["input_ids"].shape[1]
    mask = out.attention_mask
    differs_from_loc_argmax = False
    with torch.no_grad():
        for t in range(T):
            m = mask[:, :S + t]
            full = model(out.sequences[:, :S + t], out.numeric_values[:, :S + t].float(), attention_mask=m,
                         position_ids=positions(m))
            loc_U, scale_Up = full.loc_U[:, -1], model.action.noisy_scale(full.scale_U[:, -1])
            loc_S, scale_S = (x.double() for x in model.action.scores(loc_U, scale_Up, model.W_cls))
            P = 0.5 + torch.atan((loc_S - model.action.thresholds.double()) / scale_S) / math.pi
            chosen = out.new_tokens[:, t]
            p_chosen = P.gather(1, chosen[:, None]).squeeze(1)
            assert (p_chosen >= P.max(-1).values - 1e-6).all(), t
            torch.testing.assert_close(out.token_probs[:, t].double(), p_chosen, rtol=1e-5, atol=1e-6)
            differs_from_loc_argmax |= bool((loc_S.argmax(-1) != chosen).any())
    assert differs_from_loc_argmax  # argmax P is not argmax loc_S: the check has teeth


@pytest.mark.parametrize("spread", ["constant", "mild", "wild"])
def test_pruned_ovr_argmax_equals_full_argmax(spread):
    """The candidate pruning is exact: same token as the argmax of P over all rows."""
    base = small_vocab_qwen(vocab_size=6000, hidden_size=48, seed=2)
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=5990, threshold_mode="vector"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.action.num_row.mul_(3.0)
        model.action.thresholds.add_(torch.randn(6000, generator=g))
        model.action.b_cls.add_(torch.randn(6000, generator=g) * 2)
    heads = OvRScorer(model, ovr_pruning=True, cache_abs_weight=False)
    B, Cdim = 16, 48
    loc_U = torch.randn(B, Cdim, generator=g) * 3
    base_scale = torch.rand(B, 1, generator=g) * 10 + 0.1
    noise = {"constant": 0.0, "mild": 0.05, "wild": 3.0}[spread]
    scale_Up = base_scale * torch.exp(torch.randn(B, Cdim, generator=g) * noise)
    loc_U[0] *= 1000  # one row with positive z (loc_S > C) for many classes
    with torch.no_grad():
        loc_S, scale_S = model.action.scores(loc_U, scale_Up, model.W_cls)
        P = 0.5 + torch.atan((loc_S.double() - model.action.thresholds.double()) / scale_S.double()) / math.pi
        tok, p = heads.ovr_argmax(heads.loc_scores(loc_U), scale_Up)
    p_full = P.gather(1, tok[:, None]).squeeze(1)
    assert (p_full >= P.max(-1).values - 1e-6).all()
    assert (tok == P.argmax(-1)).float().mean() >= 0.9
    torch.testing.assert_close(p.double(), p_full, rtol=1e-5, atol=1e-7)


def count_bounded_rows(heads: OvRScorer) -> list[int]:
    """The number of vocabulary rows of each `_t_bounds` call of `heads` (its bounds computed row by row), in order."""
    bounded = []
    t_bounds = heads._t_bounds
    heads._t_bounds = lambda z, *a: bounded.append(z.shape[1]) or t_bounds(z, *a)
    return bounded


@pytest.mark.parametrize("case", range(8))
def test_prefilter_keeps_every_row_the_bounds_over_the_whole_vocabulary_keep(case):
    """`_candidates` bounds only the rows its cheap test of z against a bar lets through. Whatever it skips, bounding
    every row of the vocabulary would have skipped too: rows whose best t is positive (z > 0) and negative, scalar and
    vector thresholds, zero rows of W_cls (norm 0: the bound is the floor), even and uneven scale_U'."""
    g = torch.Generator().manual_seed(case)
    V, H, B = 4000, 32, 12
    model = get_causal_model(small_vocab_qwen(vocab_size=V, hidden_size=H, seed=case % 3),
                             CausalAdapterConfig(num_token_id=V - 7, threshold_mode="vector" if case % 2 else "scalar"))
    with torch.no_grad():
        if case % 4 == 1:
            model.W_cls[torch.randperm(V, generator=g)[:40]] = 0
        model.action.b_cls.add_(torch.randn(V, generator=g) * (case % 3))
        if case % 2:
            model.action.thresholds.add_(torch.randn(V, generator=g))
    heads = OvRScorer(model, ovr_pruning=True, cache_abs_weight=False)
    loc_U = torch.randn(B, H, generator=g) * (2 + case)
    loc_U[: B // 3] *= 300  # rows with z > 0 for some classes (bar >= 0) beside rows without (bar < 0)
    spread = (0.0, 0.05, 0.5, 3.0)[case % 4]
    scale_Up = (torch.rand(B, 1, generator=g) * 10 + 0.1) * torch.exp(torch.randn(B, H, generator=g) * spread)
    bounded = count_bounded_rows(heads)
    with torch.no_grad():
        z = heads.loc_scores(loc_U) - heads.thresholds
        got = heads._candidates(z, scale_Up)
        t_lo, t_hi = heads._t_bounds(z, heads._row_norms(), *heads._bound_coefficients(scale_Up))
    every = (t_hi >= t_lo.amax(-1, keepdim=True)).any(0).nonzero().squeeze(1)
    assert (z.amax(-1) > 0).any() and (z.amax(-1) < 0).any()
    if got is None:  # more than V/8 candidates: the full product decides, as it would have
        assert every.numel() > max(64, V // 8)
    else:
        assert set(every.tolist()) <= set(got.tolist())
    if spread <= 0.05:  # the cases where the bounds prune: the cheap test ran and kept few rows
        assert bounded[1] < V // 8, bounded


@pytest.mark.parametrize("case", range(6))
def test_the_bf16_product_prefilter_finds_the_float32_argmax(case):
    """The deterministic mode's pruning from a bfloat16 W_cls loc_U (`approx_loc_scores`, where bf16 products are
    cheap): every entry's error is within `_approx_error`, and the argmax and its P are those of the float32 loc_S
    over the whole vocabulary: with eos masked for some rows (their float32 argmax among the masked), a trained <NUM>
    row, rows whose best t is positive and negative, scalar and vector thresholds, even and uneven scale_U', and a
    twin of a row's argmax that bfloat16 cannot tell from it (either of the two winning in float32)."""
    g = torch.Generator().manual_seed(case)
    V, H, B = 4000, 32, 12
    model = get_causal_model(small_vocab_qwen(vocab_size=V, hidden_size=H, seed=case % 3),
                             CausalAdapterConfig(num_token_id=V - 7, threshold_mode="vector" if case % 2 else "scalar"))
    with torch.no_grad():
        model.action.b_cls.add_(torch.randn(V, generator=g) * (case % 3))
        model.action.num_row.mul_(3.0)
        if case % 2:
            model.action.thresholds.add_(torch.randn(V, generator=g))
        if case == 3:  # <NUM> the argmax of every row: it repeats among the bar's rows, where num_row must stand in
            model.action.b_cls[V - 7] += 1e4  # for W_cls's own <NUM> row, here far above it for every row
            model.W_cls[V - 7] = model.W_cls[V - 7].abs() * 50
    loc_U = torch.randn(B, H, generator=g) * (2 + case)
    loc_U[: B // 3] *= 300  # rows with z > 0 for some classes beside rows without
    if case == 3:
        loc_U = loc_U.abs()
    spread = (0.0, 0.05, 0.5)[case % 3]
    scale_Up = (torch.rand(B, 1, generator=g) * 10 + 0.1) * torch.exp(torch.randn(B, H, generator=g) * spread)
    loc_U[1], scale_Up[1] = loc_U[0], scale_Up[0]  # row 1 masks the argmax it shares with row 0, which keeps it
    # batch rows whose eos ids (their float32 argmax, as found first) are masked
    masked = (torch.tensor([1, B - 1]), torch.tensor([], dtype=torch.long))

    def full_argmax():
        """(token, P) from P over all V rows of the float32 loc_S (pruning off), eos masked."""
        exact = OvRScorer(model, ovr_pruning=False, cache_abs_weight=False)
        loc_S = exact.loc_scores(loc_U)
        loc_S[masked[0].unsqueeze(1), masked[1]] = -math.inf
        return exact.ovr_argmax(loc_S, scale_Up)

    def approximate():
        heads = OvRScorer(model, ovr_pruning=True, cache_abs_weight=False)
        approx = heads.approx_loc_scores(loc_U)
        approx[masked[0].unsqueeze(1), masked[1]] = -math.inf
        return heads, approx, heads.ovr_argmax(approx, scale_Up, loc_U)

    with torch.no_grad():
        best = full_argmax()[0]
        masked = (masked[0], best[masked[0]].unique())
        for sign in (1.0, -1.0):
            k = int(full_argmax()[0][0])
            k = k if k != V - 7 else 11  # the twin of a plain row
            twin = (k + 1 + case) % (V - 8)
            W = model.W_cls
            W[k, 0] = W[k, 0].bfloat16().float()  # bf16-exact: the twin's column 0 rounds back to it
            W[twin] = W[k]
            W[twin, 0] = W[k, 0] * (1 + sign * 2.0 ** -12)
            model.action.b_cls[twin] = model.action.b_cls[k]
            if case % 2:
                model.action.thresholds[twin] = model.action.thresholds[k]
            assert torch.equal(W[k].bfloat16(), W[twin].bfloat16()) and not torch.equal(W[k], W[twin])
            tok, p = full_argmax()
            heads, approx, (got, got_p) = approximate()
            exact_loc = heads.loc_scores(loc_U)
            finite = torch.isfinite(approx)
            assert ((approx - exact_loc).abs() <= heads._approx_error(loc_U, approx))[finite].all()
            rows = torch.tensor([V - 7, k, V - 7, twin, V - 7])  # the bar's rows repeat: <NUM> (num_row) each time
            got_rows = heads._exact_loc(loc_U, rows, approx)
            kept = finite.index_select(1, rows)
            torch.testing.assert_close(got_rows[kept], exact_loc.index_select(1, rows)[kept], rtol=1e-5, atol=1e-3)
            assert torch.equal(got, tok), (got, tok)
            torch.testing.assert_close(got_p, p, rtol=1e-6, atol=0)
    assert not torch.isin(tok[masked[0]], masked[1]).any()  # the masked argmax was not chosen


@pytest.mark.parametrize("autocast", [False, True])
def test_the_bf16_product_prefilter_gives_the_same_generation(bases, tok, monkeypatch, autocast):
    """Deterministic generation with the bfloat16 product forced on and off (whatever this CPU has): the same tokens,
    values and probabilities; the bf16 product ran. Under a bf16 CPU autocast too (the backbone in bf16, the heads,
    the bf16 product and the float32 rows as without it)."""
    import causal_adapter.modeling.scoring as scoring

    model = perturb(get_causal_model(bases["qwen3"], CausalAdapterConfig(gamma0=3.0), tokenizer=tok), seed=6)
    enc = NumberTokenizer(tok)(["In 1749 the sunspot number was 80.9", "Price: 99.9 yuan", "The Nile at Aswan"],
                               padding_side="left")
    calls = []
    approx_vocab = scoring.OvRScorer.approx_vocab
    monkeypatch.setattr(scoring.OvRScorer, "approx_vocab", lambda self, x: calls.append(1) or approx_vocab(self, x))
    outs = []
    for fast in (True, False):
        monkeypatch.setattr(scoring, "fast_bf16_product", lambda W, fast=fast: fast)
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs.append(model.generate(enc, mode="deterministic", max_new_tokens=8, eos_token_id=[]))
        assert bool(calls) == fast
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].numeric_values, outs[1].numeric_values)
    torch.testing.assert_close(outs[0].token_probs, outs[1].token_probs, rtol=1e-6, atol=0)


def _approx_heads(V=512, H=256, seed=0):
    """A model whose W_cls is V x H (one layer, a small MLP: H large enough for the float32 sums to count), with
    noisy b_cls and vector thresholds, and the generator that drew them. The tests call the bf16 product directly,
    whatever this CPU has."""
    model = get_causal_model(small_vocab_qwen(vocab_size=V, hidden_size=H, num_layers=1, intermediate_size=16,
                                              seed=seed),
                             CausalAdapterConfig(num_token_id=V - 7, threshold_mode="vector"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.action.b_cls.add_(torch.randn(V, generator=g) * 2)
        model.action.thresholds.add_(torch.randn(V, generator=g))
        model.action.num_row.mul_(3.0)
    return model, g


def test_the_bf16_product_error_reaches_most_of_its_bound_when_every_rounding_errs_the_same_way():
    """`_approx_error` is a rigorous bound, and not a loose one: with every entry of loc_U and of a W_cls row
    1 + 2^-8 - 2^-20 (bfloat16 rounds each down to 1, by nearly u = 2^-8), all H products err the same way and the
    bf16 product misses by about 2u of its size: 0.65 of the bound, against a float32 product and the exact one.
    (Random entries reach a small part of it.)"""
    from causal_adapter.modeling.scoring import OvRScorer

    model, g = _approx_heads()
    V, H = model.W_cls.shape
    a = 1 + 2.0 ** -8 - 2.0 ** -20
    assert float(torch.tensor(a).bfloat16()) == 1.0
    with torch.no_grad():
        model.W_cls[:4] = a
        model.W_cls[1] = -a  # the same, negative
        model.action.b_cls[:2] = 0.0  # the product alone
        model.action.b_cls[2:4] = 300.0  # ... and with a large bias (its rounding has room in the bound)
    heads = OvRScorer(model, ovr_pruning=True, cache_abs_weight=False)
    loc_U = torch.randn(3, H, generator=g) * 3
    loc_U[0] = a
    loc_U[1, : H // 2] = a  # half the terms err the same way, the rest random
    with torch.no_grad():
        approx = heads.approx_loc_scores(loc_U)
        bound = heads._approx_error(loc_U, approx)
        exact32 = heads.loc_scores(loc_U)
        W = model.action.effective_rows(torch.arange(V), model.W_cls).double()  # <NUM>'s row: num_row
        exact64 = loc_U.double() @ W.T + model.action.b_cls.double()
    for exact in (exact32.double(), exact64):
        ratio = (approx.double() - exact).abs() / bound.double()
        assert (ratio <= 1).all(), ratio.max()
        assert ratio[0, :2].min() > 0.6, ratio[0, :4]  # a bound half as large would not hold here


def test_the_bf16_product_error_bound_is_its_documented_terms():
    """`_approx_error` recomputed in float64 from the terms its docstring names, per entry k (u = 2^-8, N_k =
    ||W_k||_1 of the effective W_cls, M = max_j |x_j|, L_k = loc_S~_k): the operands' rounding (2u + u^2) N_k M, the
    float32 sums of the bf16 and of the exact product H 2^-24 N_k M each, the bf16 result's rounding u/(1-u) of its
    size (<= |L_k| + |b_k|), adding b_cls and subtracting C 2^-24 of each one's size. The bound is at least their sum,
    and equals it with the code's widening (1.01 on the product terms, 1.02 u + 2^-20 for u/(1-u), 2^-20 for 2^-24):
    a term lost or scaled shows."""
    from causal_adapter.modeling.scoring import OvRScorer

    model, g = _approx_heads(seed=1)
    V, H = model.W_cls.shape
    heads = OvRScorer(model, ovr_pruning=True, cache_abs_weight=False)
    loc_U = torch.randn(4, H, generator=g) * torch.tensor([[0.1], [1.0], [30.0], [1000.0]])
    with torch.no_grad():
        approx = heads.approx_loc_scores(loc_U)
        bound = heads._approx_error(loc_U, approx).double()
        W = model.action.effective_rows(torch.arange(V), model.W_cls).double()
    u, e = 2.0 ** -8, 2.0 ** -24
    N = W.abs().sum(-1)
    M = loc_U.double().abs().amax(-1, keepdim=True)
    L = approx.double().abs()
    b = model.action.b_cls.detach().double().abs()
    C = heads.thresholds.detach().double().abs().expand(V)
    product = N * M  # sum_j |W_kj x_j| <= ||W_k||_1 max_j |x_j|
    operands, sums = (2 * u + u * u) * product, 2 * H * e * product
    documented = operands + sums + u / (1 - u) * (L + b) + e * (L + b) + e * (b + C)
    assert (bound >= documented).all(), (documented / bound).max()
    widened = 1.01 * (operands + sums) + (1.02 * u + 16 * e) * (L + b) + 16 * e * (b + C)
    torch.testing.assert_close(bound, widened, rtol=2e-6, atol=0)
    assert (sums / widened).min() > 2e-4  # the float32 sums' term is far above that tolerance


def test_prefilter_leaves_few_rows_to_bound_in_the_usual_case(bases, tok):
    """The heads of a real-vocabulary model on real prompts, as generation meets them: the cheap test leaves a small
    part of the 151,936 rows to bound one by one, and the argmax is the unpruned one."""
    model = perturb(get_causal_model(bases["qwen3"], CausalAdapterConfig(gamma0=3.0), tokenizer=tok), seed=6)
    enc = NumberTokenizer(tok)(["In 1749 the sunspot number was 80.9", "Price: 99.9 yuan", "The Nile at Aswan"],
                              padding_side="left")
    with torch.no_grad():
        out = model(enc["input_ids"], enc["numeric_values"].float(), attention_mask=enc["attention_mask"],
                    position_ids=positions(enc["attention_mask"]))
    loc_U, scale_Up = out.loc_U[:, -1], model.action.noisy_scale(out.scale_U[:, -1])
    heads = OvRScorer(model, ovr_pruning=True, cache_abs_weight=False)
    bounded = count_bounded_rows(heads)
    with torch.no_grad():
        loc_S = heads.loc_scores(loc_U)
        pruned, _ = heads.ovr_argmax(loc_S, scale_Up)
        full, _ = OvRScorer(model, ovr_pruning=False, cache_abs_weight=False).ovr_argmax(loc_S, scale_Up)
    assert torch.equal(pruned, full)
    assert bounded[-1] < heads.V // 100, bounded


# --------------------------------------------------------------------------- causal mode
def test_causal_seeds_and_shared_individual():
    model = small_model(num_bias=2.0, gamma0=0.5)
    ids, vals, mask = small_prompts()
    kw = dict(input_ids=ids, numeric_values=vals, attention_mask=mask, mode="causal", max_new_tokens=8,
              eos_token_id=[], return_eps=True)
    a, b = model.generate(seed=1, **kw), model.generate(seed=1, **kw)
    c = model.generate(seed=2, **kw)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.numeric_values, b.numeric_values)
    assert not torch.equal(a.new_tokens, c.new_tokens)
    g = torch.Generator().manual_seed(1)
    assert torch.equal(model.generate(generator=g, **kw).sequences, a.sequences)
    # fresh eps: the protocol draws one (B, C) uniform per step; different steps differ
    g = torch.Generator().manual_seed(1)
    expected = torch.stack([torch.rand((2, 32), generator=g, dtype=torch.float64) for _ in range(8)], 1)
    torch.testing.assert_close(a.eps, expected, rtol=0, atol=1e-15)
    assert not torch.equal(a.eps[:, 0], a.eps[:, 1])

    s = model.generate(seed=1, shared_individual=True, **kw)
    assert s.eps.shape == (2, 8, 32)
    assert torch.equal(s.eps, s.eps[:, :1].expand_as(s.eps))  # one individual per sequence
    assert not torch.equal(s.eps[0, 0], s.eps[1, 0])
    torch.testing.assert_close(s.eps[:, 0], expected[:, 0], rtol=0, atol=1e-15)
    # and that one eps is what acted at every step: independent recomputation from it
    ref_ids, ref_vals = reference_generate(model, ids, vals, mask, "causal", 8, seed=1, shared=True)
    assert torch.equal(s.new_tokens, ref_ids)
    torch.testing.assert_close(s.new_values, ref_vals, rtol=0, atol=1e-5)
    assert not torch.equal(s.new_tokens, a.new_tokens)


def test_causal_decision_is_not_argmax_of_saturated_P():
    """At init with C = 100, P with scale 0 would be 0 for every row (ties -> token 0)."""
    model = small_model(num_bias=0.0, gamma0=0.5)
    ids, vals, mask = small_prompts()
    out = model.generate(input_ids=ids, numeric_values=vals, attention_mask=mask, mode="causal", max_new_tokens=6,
                         seed=0, eos_token_id=[])
    assert (out.new_tokens != 0).all() and len(set(out.new_tokens.flatten().tolist())) > 3


# --------------------------------------------------------------------------- <NUM> feedback
@pytest.mark.parametrize("mode", ["softmax", "deterministic", "causal"])
def test_generated_number_is_fed_back_and_rendered(mode, tok, bases):
    base = bases["qwen2"]
    model = get_causal_model(base, CausalAdapterConfig(gamma0=1.0), tokenizer=tok)
    assert model.num_token_id == NUM_REAL
    with torch.no_grad():
        model.action.b_cls[NUM_REAL] = 500.0  # <NUM> wins in every mode
        model.action.b_reg.fill_(42.5)
    seen = []
    hook = model.decoder.register_forward_pre_hook(lambda mod, a, kw: seen.append(kw["inputs_embeds"].clone()),
                                                   with_kwargs=True)
    try:
        out = model.generate("The price was 99.9 yuan, then", tokenizer=tok, mode=mode, max_new_tokens=4,
                             seed=0, eos_token_id=[])
    finally:
        hook.remove()
    assert (out.new_tokens == NUM_REAL).all()
    v = out.new_values[0]
    assert (v != 0).all() and len(set(v.tolist())) > 1
    E, d = base.get_input_embeddings().weight, model.numeric_embedding.direction
    assert len(seen) == 4 and seen[0].shape[1] == out.sequences.shape[1] - 4  # prefill, then one position per step
    for t in range(1, 4):
        x = float(v[t - 1])
        expected = E[NUM_REAL] + math.copysign(math.log1p(abs(x)), x) * d
        assert seen[t].shape == (1, 1, 32)
        torch.testing.assert_close(seen[t][0, 0], expected, rtol=1e-5, atol=1e-6)
    # the text shows the numbers: reading it back gives the generated values (format precision)
    assert [n.value for n in find_numbers(out.texts[0])] == pytest.approx(v.tolist(), rel=1e-5)
    assert all(format_number(x) in out.texts[0] for x in v.tolist())
    nums = out.numbers[0]
    assert [n["position"] for n in nums] == [0, 1, 2, 3]
    for n, x in zip(nums, v.tolist()):
        assert n["value"] == pytest.approx(x) and n["text"] == format_number(x)
        lo, hi = n["interval_50"]
        assert lo == pytest.approx(n["loc"] - n["scale"]) and hi == pytest.approx(n["loc"] + n["scale"])
        lo, hi = n["interval_90"]
        assert hi - n["loc"] == pytest.approx(n["scale"] * math.tan(0.45 * math.pi))
        if mode != "causal":
            assert n["loc"] == pytest.approx(x)
    # the prompt's own number went in as a value too
    assert (out.numeric_values[0] != 0).sum() == 5
    assert out.numeric_values[0, :-4][out.sequences[0, :-4] == NUM_REAL].tolist() == pytest.approx([99.9])


@pytest.mark.parametrize("mode", ["deterministic", "causal"])
def test_rounded_value_is_fed_back_over_several_numbers(mode, tok, bases):
    """With value_decimals, every generated number is emitted, shown AND fed back rounded (as the data
    writes values): the embedding of step t holds phi of the rounded value of step t-1, for several
    numbers in a row. Values near value_loc, where phi is steep, and whole numbers (value_decimals=0)
    make the rounding move phi well beyond float error."""
    base = bases["qwen2"]
    model = get_causal_model(base, CausalAdapterConfig(gamma0=1.0), tokenizer=tok)
    model.set_value_units(40.0, 1.0, value_decimals=0)
    with torch.no_grad():
        model.action.b_cls[NUM_REAL] = 500.0  # <NUM> wins at every step
        model.action.w_reg.mul_(3.0)  # values a few units apart, with many decimals
    seen = []
    hook = model.decoder.register_forward_pre_hook(lambda mod, a, kw: seen.append(kw["inputs_embeds"].clone()),
                                                   with_kwargs=True)
    try:
        out = model.generate("The price was 39.9 yuan, then", tokenizer=tok, mode=mode, max_new_tokens=5, seed=0,
                             eos_token_id=[])
    finally:
        hook.remove()
    assert (out.new_tokens == NUM_REAL).all()
    nums = out.numbers[0]
    exact = torch.tensor([n["exact"] for n in nums], dtype=torch.float64)
    rounded = torch.round(exact)
    assert len(set(rounded.tolist())) >= 2 and ((exact - rounded).abs() > 0.05).sum() >= 3  # rounding matters
    torch.testing.assert_close(out.new_values[0].double(), rounded, rtol=0, atol=1e-4)
    assert [n["text"] for n in nums] == [format_number(x) for x in rounded.tolist()]
    assert len(seen) == 5
    for t in range(1, 5):  # steps 1..4 are fed the numbers of steps 0..3
        ids = torch.tensor([[NUM_REAL]])
        fed = model.embed(ids, rounded[t - 1].reshape(1, 1).float())[0, 0]
        unrounded = model.embed(ids, exact[t - 1].reshape(1, 1).float())[0, 0]
        if abs(float(exact[t - 1] - rounded[t - 1])) > 0.05:  # the check below can tell them apart
            assert (fed - unrounded).abs().max() > 1e-4  # 100 x the tolerance below
        torch.testing.assert_close(seen[t][0, 0], fed, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- text in / out, batching
def test_text_prompts_batch_left_padding_equals_single_rows(tok, bases):
    base = bases["qwen2_f64"]
    model = get_causal_model(base, CausalAdapterConfig(gamma0=2.0), tokenizer=tok)
    perturb(model, seed=9, num_bias=6.0)
    prompts = ["In 1749 the yearly sunspot number was 80.9; in 1750 it was", "It costs 3 dollars"]
    ntok = NumberTokenizer(tok)
    enc = ntok(prompts, padding_side="left")
    tok(["a", "bb"], padding=True)  # leaves padding on in the backend: generate must not be affected
    for mode in ("softmax", "deterministic"):
        batch = model.generate(prompts, tokenizer=ntok, mode=mode, max_new_tokens=6, eos_token_id=[])
        for i, p in enumerate(prompts):
            one = generate(model, p, tokenizer=tok, mode=mode, max_new_tokens=6, eos_token_id=[])
            assert torch.equal(one.new_tokens[0], batch.new_tokens[i]), (mode, i)
            torch.testing.assert_close(one.new_values[0], batch.new_values[i], rtol=0, atol=1e-9)
            assert one.texts[0] == batch.texts[i]
            assert batch.texts[i] == ntok.decode(batch.new_tokens[i].tolist(), batch.new_values[i].tolist(),
                                                 skip_special_tokens=True)
    same = model.generate(input_ids=enc["input_ids"], numeric_values=enc["numeric_values"],
                          attention_mask=enc["attention_mask"], mode="deterministic", max_new_tokens=6, eos_token_id=[])
    assert torch.equal(same.sequences, batch.sequences) and same.texts is None


def test_stop_strings_streamer_and_callback(tok, bases):
    from transformers import TextStreamer

    base = bases["qwen3"]
    model = get_causal_model(base, tokenizer=tok)
    prompt = "Once upon a time"
    full = model.generate(prompt, tokenizer=tok, mode="softmax", max_new_tokens=12, eos_token_id=[])
    toks = full.new_tokens[0].tolist()
    prefixes = [tok.decode(toks[:j + 1]) for j in range(12)]
    stop = prefixes[6][len(prefixes[5]) - 2:]  # text completed by token 6
    first = next(j for j, p in enumerate(prefixes) if stop in p)
    assert first < 11
    cut = model.generate(prompt, tokenizer=tok, mode="softmax", max_new_tokens=12, eos_token_id=[],
                         stop_strings=[stop])
    assert cut.lengths[0].item() == first + 1 and cut.finished[0].item()
    assert cut.texts[0] == prefixes[first] and full.texts[0].startswith(cut.texts[0])

    steps = []
    buf = io.StringIO()
    out = model.generate(prompt, tokenizer=tok, mode="softmax", max_new_tokens=12, eos_token_id=[],
                         streamer=NumberStreamer(tok, file=buf),
                         callback=lambda t, ids, vals: steps.append((t, ids.clone(), vals.clone())))
    assert [s[0] for s in steps] == list(range(12))
    assert torch.equal(torch.stack([s[1] for s in steps], 1), out.new_tokens)
    assert buf.getvalue() == out.texts[0] + "\n"
    model.generate(prompt, tokenizer=tok, mode="softmax", max_new_tokens=3,
                   streamer=TextStreamer(tok, skip_prompt=True))  # transformers' own streamer works


def test_number_streamer_separates_a_number_generated_after_a_prompt_final_number(qwen_tokenizer):
    tok = qwen_tokenizer
    ntok = NumberTokenizer(tok)
    enc = ntok("Sunspots by year: 12 15")  # the prompt ends with a number
    buf = io.StringIO()
    st = NumberStreamer(tok, file=buf)
    st.put(enc["input_ids"], numeric_values=enc["numeric_values"])
    st.put(torch.tensor([ntok.num_token_id]), numeric_values=torch.tensor([17.0]))
    st.put(torch.tensor(tok(",").input_ids), numeric_values=torch.zeros(1))
    st.end()
    assert buf.getvalue() == " 17,\n"  # not "17,": the two numbers must stay two numbers
    prompt_and_text = "Sunspots by year: 12 15" + buf.getvalue().rstrip("\n")
    assert [n.value for n in find_numbers(prompt_and_text)] == [12.0, 15.0, 17.0]
    st2 = NumberStreamer(tok, file=io.StringIO())  # prompt ending in text: nothing added
    enc2 = ntok("Sunspots in 1850 were")
    st2.put(enc2["input_ids"], numeric_values=enc2["numeric_values"])
    st2.put(torch.tensor([ntok.num_token_id]), numeric_values=torch.tensor([17.0]))
    st2.end()
    assert st2.text == ntok.decode([ntok.num_token_id], [17.0])


def test_softmax_sampling_controls():
    model = small_model()
    ids, vals, mask = small_prompts()
    kw = dict(input_ids=ids, numeric_values=vals, attention_mask=mask, mode="softmax", max_new_tokens=8,
              eos_token_id=[])
    greedy = model.generate(**kw)
    assert torch.equal(model.generate(top_k=1, seed=0, **kw).sequences, greedy.sequences)
    a, b = model.generate(top_k=50, seed=5, **kw), model.generate(top_k=50, seed=5, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert not torch.equal(a.sequences, model.generate(top_k=50, seed=6, **kw).sequences)
    # every sampled token is in the top-3 of loc_S at its step (full forward)
    out = model.generate(top_k=3, temperature=2.0, seed=1, **kw)
    with torch.no_grad():
        for t in range(8):
            m = out.attention_mask[:, :7 + t]
            loc_S = model(out.sequences[:, :7 + t], out.numeric_values[:, :7 + t], attention_mask=m,
                          position_ids=positions(m), return_scores=True).loc_S[:, -1]
            assert (loc_S.topk(3, -1).indices == out.new_tokens[:, t:t + 1]).any(-1).all()


def test_bad_arguments_are_clear():
    model = small_model()
    ids, vals, mask = small_prompts()
    with pytest.raises(ValueError, match="mode"):
        model.generate(input_ids=ids, mode="greedy")
    with pytest.raises(ValueError, match="LEFT padding"):
        model.generate(input_ids=ids, attention_mask=mask.flip(-1))
    with pytest.raises(ValueError, match="softmax"):
        model.generate(input_ids=ids, mode="deterministic", temperature=0.5)
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate("text without a tokenizer")
    out = model.generate(input_ids=ids, numeric_values=vals, attention_mask=mask, max_new_tokens=0)
    assert torch.equal(out.sequences, ids) and out.new_tokens.shape == (2, 0)


def test_row_norm_cache_follows_weight_updates():
    """The pruning bounds use per-row norms cached across calls: an in-place update of W_cls
    (an optimizer step) must invalidate them, or a row that grew would be pruned wrongly."""
    base = small_vocab_qwen(vocab_size=3000, hidden_size=32, seed=4)
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=2990))
    ids = torch.randint(0, 2900, (1, 5), generator=torch.Generator().manual_seed(0))
    first = model.generate(input_ids=ids, max_new_tokens=1, eos_token_id=[]).new_tokens[0, 0].item()
    other = (first + 7) % 2900
    with torch.no_grad():
        model.W_cls[other] *= 3.0  # its ||W||_1 triples: at C = 100 it becomes argmax P
    pruned = model.generate(input_ids=ids, max_new_tokens=1, eos_token_id=[])
    full = model.generate(input_ids=ids, max_new_tokens=1, eos_token_id=[], ovr_pruning=False)
    assert torch.equal(pruned.sequences, full.sequences)
    assert pruned.new_tokens[0, 0].item() == other


def test_text_after_a_prompt_ending_with_a_number(tok):
    """Prompt "... 80.9" + a generated <NUM>: the new text must keep the two numbers apart."""
    model = get_causal_model(build_tiny_qwen("qwen2", hidden_size=32, seed=8), tokenizer=tok)
    with torch.no_grad():
        model.action.b_cls[NUM_REAL] = 500.0
        model.action.b_reg.fill_(7.0)
    prompt = "The sunspot number was 80.9"
    out = model.generate(prompt, tokenizer=tok, mode="deterministic", max_new_tokens=2, eos_token_id=[])
    assert out.sequences[0, -3].item() == NUM_REAL == out.new_tokens[0, 0].item()
    values = [n.value for n in find_numbers(prompt + out.texts[0])]
    assert values == pytest.approx([80.9] + out.new_values[0].tolist(), rel=1e-5)


def test_generate_command_draws_its_progress_bar_only_for_several_rows_or_a_terminal(capsys):
    """`causal-adapter generate "prompt"` piped (`2>&1`): no bar before the answer; several prompts: the bar."""
    import os

    from causal_adapter.commands.generate import show_progress
    from causal_adapter.commands.main import main

    tiny = ["--tiny-hidden-size", "32", "--tiny-layers", "1", "--max-new-tokens", "2"]
    assert main(["generate", "The price was", *tiny]) == 0
    one = capsys.readouterr()
    assert one.out.startswith("The price was") and "row" not in one.err and "generate:" not in one.err
    assert main(["generate", "The price was", "Hello", *tiny]) == 0
    two = capsys.readouterr().err
    assert "generate: 100%" in two and "2/2" in two
    master, slave = os.openpty()  # a real terminal: one row gets its bar there
    with os.fdopen(slave, "w") as terminal:
        assert show_progress(1, False, terminal) and not show_progress(1, True, terminal)
    os.close(master)
    with open(os.devnull, "w") as pipe:
        assert not show_progress(1, False, pipe) and show_progress(2, False, pipe) and not show_progress(2, True, pipe)


# --------------------------------------------------------------------------- causal value in the head's units
def _numbers_prompts():
    """Two left-padded prompts with four numbers each (one kind: a row gets its own per-row units)."""
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 290, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2], ids[1, :2] = 0, 0
    vals = torch.zeros(2, 10, dtype=torch.float64)
    for row, series in ((0, (12.0, 13.5, 12.75, 14.0)), (1, (-310.0, -290.0, -305.0, -280.0))):
        for pos, v in zip((3, 5, 7, 9), series):
            ids[row, pos], vals[row, pos] = NUM_SMALL, v
    return ids, vals, mask


@pytest.mark.parametrize("units", ["adapter", "adapter_recent", "row"])
def test_causal_value_is_the_heads_cauchy_at_the_sampled_u_in_value_units(units):
    """Causal mode writes, for each generated number, the value head's own Cauchy at the quantile the sampled
    individual u gives it, in value units: loc_Y + scale_Y t, t = w_reg . (u - loc_U) / (|w_reg| . scale_U'), with
    u = loc_U + scale_U' tan(pi (eps - 1/2)) from the returned eps (the token's u). Checked against one full forward
    over the generated sequence, on units other than (0, 1) (a value left in standardised units is off by the units:
    scale_Y = 3 |b_noise_Y|), in per-row units with w_reg != 0 (each row's own unit), and with the head also reading
    the 4 most recent numbers (w_recent != 0: loc_Y moves with them); t differs from 0 (a value ignoring u is loc_Y)."""
    cfg = dict(num_token_id=NUM_SMALL, gamma0=1.0, regression_scale="independent", b_noise_Y_init=0.7)
    if units != "adapter":
        cfg.update(recent_values=4, value_row_units="last" if units == "row" else None)
    base = stir(small_vocab_qwen(dtype=torch.float64, hidden_size=32, seed=2), seed=2)
    model = perturb(get_causal_model(base, CausalAdapterConfig(**cfg)), seed=2, num_bias=500.0, b_reg=0.3)
    act = model.action
    if units != "row":
        model.set_value_units(40.0, 3.0)
    if units == "adapter_recent":
        with torch.no_grad():
            act.w_recent.copy_(torch.tensor([0.6, 0.3, -0.2, 0.1], dtype=act.w_recent.dtype))
    assert bool(act.w_reg.abs().sum() > 0)
    ids, vals, mask = _numbers_prompts()
    T = 5
    out = model.generate(input_ids=ids, numeric_values=vals, attention_mask=mask, mode="causal", max_new_tokens=T,
                         eos_token_id=[], seed=5, return_eps=True)
    assert (out.new_tokens == NUM_SMALL).all()  # every step writes a number, fed back to the next
    full_mask = torch.cat([mask, torch.ones(2, T, dtype=mask.dtype)], 1)
    with torch.no_grad():
        f = model(out.sequences, out.numeric_values, attention_mask=full_mask, position_ids=positions(full_mask))
        at = slice(ids.shape[1] - 1, ids.shape[1] - 1 + T)  # the positions that chose the new tokens
        loc_U, loc_Y, scale_Y = f.loc_U[:, at], f.loc_Y[:, at], f.scale_Y[:, at]
        scale_Up = act.noisy_scale(f.scale_U[:, at])
        u = loc_U + scale_Up * torch.tan(math.pi * (out.eps - 0.5))
        t = ((u - loc_U) @ act.w_reg) / (scale_Up @ act.w_reg.abs())
        expected = loc_Y + scale_Y * t
        unit = scale_Y / act.b_noise_Y.abs()
    if units != "row":
        torch.testing.assert_close(unit, torch.full_like(unit, 3.0), rtol=1e-12, atol=0)
    else:  # each row's own unit, not the adapter's
        assert act.row_rule == "last" and not torch.allclose(unit, torch.full_like(unit, act.head_scale))
    assert float(t.abs().min()) > 1e-3  # u moves the value: a value ignoring u would differ
    torch.testing.assert_close(out.new_values, expected, rtol=1e-7, atol=1e-9)
