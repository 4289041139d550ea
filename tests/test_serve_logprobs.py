"""``logprobs`` and ``echo`` of ``/v1/completions`` (docs/serving.md, docs/evaluate.md): a live `causal-adapter serve`
in a subprocess driven with the `openai` client and httpx, nothing mocked. A float64 tiny base saved to disk serves
three adapters: ``fresh`` (at initialisation: its softmax logprobs are the base model's, checked against the base's
own log_softmax to 1e-9), ``num`` (heads perturbed, a <NUM> bias, value units) and ``log`` (the same under a log value
map). Each number's logprob is checked against a reference computed here from the model's forward: log_softmax of
loc_S at <NUM> plus the log of the Cauchy CDF difference over half a written unit either side (torch.distributions)."""
import math

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra: pip install 'causal_adapter[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra: pip install 'causal_adapter[serve]'")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from causal_adapter import CausalModel, get_causal_model  # noqa: E402
from causal_adapter.modeling.loglikelihood import written_half_unit  # noqa: E402
from causal_adapter.numbers import NumberTokenizer, find_numbers  # noqa: E402
from causal_adapter.saving.assets import build_tiny_qwen  # noqa: E402
from serve_fixtures import Server  # noqa: E402
from test_generation import perturb  # noqa: E402

TEXT = "The cat sat on the mat and looked at the door"
NUMBERS = "Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971: 66.6"


def float64_base_and_adapters(d, qwen_tokenizer):
    """The float64 toy base (with the tokenizer) saved at d/base, a fresh adapter at d/fresh and one whose `<NUM>`
    row and value head are moved at d/num; returns the base."""
    base = build_tiny_qwen("qwen2", hidden_size=32, num_layers=1, dtype=torch.float64)
    base.save_pretrained(d / "base")
    qwen_tokenizer.save_pretrained(d / "base")
    get_causal_model(base, tokenizer=qwen_tokenizer).save_pretrained(d / "fresh")
    num = perturb(get_causal_model(base, tokenizer=qwen_tokenizer), seed=3, num_bias=12.0, b_reg=0.0)
    num.set_value_units(60.0, 40.0, 1)
    num.save_pretrained(d / "num")
    return base


@pytest.fixture(scope="module")
def setup(tmp_path_factory, qwen_tokenizer):
    d = tmp_path_factory.mktemp("logprobs")
    base = float64_base_and_adapters(d, qwen_tokenizer)
    log = perturb(get_causal_model(base, tokenizer=qwen_tokenizer), seed=4, num_bias=12.0, b_reg=0.0)
    log.set_value_transform("log", log_units=(4.0, 1.0), positive=True)
    log.save_pretrained(d / "log")
    server = Server(["--base", str(d / "base"), "--dtype", "float64", "--adapter", f"fresh={d / 'fresh'}",
                     "--adapter", f"num={d / 'num'}", "--adapter", f"log={d / 'log'}"], d / "serve.log")
    try:
        yield {"dir": d, "base": base, "url": server.wait_ready().url}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def local(setup, name, tokenizer):
    return CausalModel.from_pretrained(setup["base"], setup["dir"] / name, tokenizer=tokenizer).eval()


def reference(model, ntok, text, pieces=()):
    """[n] the log-probability of every token of `text` after the first, then of the generated `pieces` (a number's
    text, or one token's), from the forward's loc_S / loc_Y / scale_Y (a number: log p(<NUM>) + log P(the value rounds
    to its written text))."""
    e = ntok.encode(text)
    ids, values, texts = list(e.input_ids), list(e.numeric_values), list(e.number_texts)
    for p in pieces:
        numbers = find_numbers(p)
        if numbers:
            ids, values, texts = ids + [model.num_token_id], values + [numbers[0].value], texts + [numbers[0].source]
        else:
            (tid,) = ntok.tokenizer(p).input_ids
            ids, values, texts = ids + [tid], values + [0.0], texts + [None]
    with torch.no_grad():
        out = model(torch.tensor([ids]), torch.tensor([values], dtype=torch.float32), return_scores=True)
    logp = torch.log_softmax(out.loc_S[0, :-1].double(), -1)
    lps = []
    for t in range(1, len(ids)):
        lp = float(logp[t - 1, ids[t]])
        if ids[t] == model.num_token_id:
            v, h = values[t], written_half_unit(texts[t])
            c = torch.distributions.Cauchy(out.loc_Y[0, t - 1].double(), out.scale_Y[0, t - 1].double())
            lo, hi = (math.log(v - h), math.log(v + h)) if model.value_map.log else (v - h, v + h)
            hi, lo = torch.tensor(hi, dtype=torch.float64), torch.tensor(lo, dtype=torch.float64)
            lp += math.log(float(c.cdf(hi) - c.cdf(lo)))
        lps.append(lp)
    return lps


def test_echo_at_initialisation_is_the_base_models_log_softmax(setup, client, qwen_tokenizer):
    r = client.completions.create(model="fresh", prompt=TEXT, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == TEXT and "".join(lp.tokens) == TEXT
    ids = qwen_tokenizer(TEXT).input_ids
    with torch.no_grad():
        want = torch.log_softmax(setup["base"](torch.tensor([ids])).logits[0, :-1], -1)
    want = [float(want[t - 1, ids[t]]) for t in range(1, len(ids))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-9, rel=0)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, chosen, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == chosen and 2 <= len(top) <= 3  # the two best, and the chosen one


@pytest.mark.parametrize("name", ["num", "log"])
def test_a_number_scores_its_written_interval(setup, client, qwen_tokenizer, name):
    model = local(setup, name, qwen_tokenizer)
    ntok = NumberTokenizer(qwen_tokenizer, model.num_token_id)
    lp = client.completions.create(model=name, prompt=NUMBERS, max_tokens=0, echo=True, logprobs=1).choices[0].logprobs
    want = reference(model, ntok, NUMBERS)
    assert lp.tokens[-1] == "66.6" and "".join(lp.tokens) == NUMBERS
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-9, rel=0)
    # the number term is a probability: <= the <NUM> token's own log-probability, and it moves with the written text
    coarse = client.completions.create(model=name, prompt=NUMBERS[:-2], max_tokens=0, echo=True,
                                       logprobs=0).choices[0].logprobs
    assert coarse.tokens[-1] == "66" and coarse.token_logprobs[-1] > lp.token_logprobs[-1]


def test_generated_tokens_carry_their_logprobs(setup, client, qwen_tokenizer):
    r = client.completions.create(model="num", prompt=NUMBERS[:-5], max_tokens=4, logprobs=3,
                                  extra_body={"mode": "softmax"})
    c = r.choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.tokens) == r.usage.completion_tokens
    model = local(setup, "num", qwen_tokenizer)
    ntok = NumberTokenizer(qwen_tokenizer, model.num_token_id)
    full = reference(model, ntok, NUMBERS[:-5], lp.tokens)
    assert lp.token_logprobs == pytest.approx(full[-len(lp.tokens):], abs=1e-9, rel=0)
    assert all(len(top) <= 4 and top[t] == x for t, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    # echo in front: the prompt's entries, then the same generated ones
    e = client.completions.create(model="num", prompt=NUMBERS[:-5], max_tokens=4, logprobs=3,
                                  extra_body={"mode": "softmax"}, echo=True).choices[0]
    assert e.text == NUMBERS[:-5] + c.text and e.logprobs.token_logprobs[-len(lp.tokens):] == lp.token_logprobs


def test_token_id_prompts_are_answered_in_their_tokens(setup, qwen_tokenizer):
    """lm-eval's local-completions sends Qwen token ids: a number's digits are separate tokens there; the number is
    scored once, on its last digit, so a sum over the given tokens is the number-aware score."""
    ids = qwen_tokenizer(NUMBERS).input_ids
    r = httpx.post(setup["url"] + "/v1/completions", json={"model": "num", "prompt": [ids], "max_tokens": 1,
                                                           "echo": True, "logprobs": 1, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and "".join(lp["tokens"][:len(ids)]) == NUMBERS
    model = local(setup, "num", qwen_tokenizer)
    want = reference(model, NumberTokenizer(qwen_tokenizer, model.num_token_id), NUMBERS)
    assert sum(lp["token_logprobs"][1:len(ids)]) == pytest.approx(sum(want), abs=1e-8, rel=0)
    assert lp["token_logprobs"][len(ids) - 1] == pytest.approx(want[-1], abs=1e-9, rel=0)  # "6" of 66.6: the number
    assert lp["token_logprobs"][len(ids) - 2] == 0.0  # "." inside it


@pytest.mark.parametrize("body, param, words", [
    ({"logprobs": 21}, "logprobs", "at most 20"),
    ({"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ({"echo": True, "stream": True}, "echo", "stream"),
    ({"logprobs": 1, "stream": True}, "logprobs", "stream"),
    ({"max_tokens": 0}, "max_tokens", "echo"),
    ({"prompt": [[1, 2], [10 ** 9]], "echo": True, "max_tokens": 0}, "prompt", "vocabulary"),
])
def test_bad_logprobs_requests_are_400s_that_name_the_field(setup, body, param, words):
    r = httpx.post(setup["url"] + "/v1/completions", json={"model": "num", "prompt": "x", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_chat_still_refuses_logprobs(setup):
    r = httpx.post(setup["url"] + "/v1/chat/completions", json={"model": "num", "logprobs": True,
                                                                "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_a_log_adapters_served_values_and_intervals_are_in_value_units(setup, client, qwen_tokenizer):
    """The ``log`` adapter (its Cauchy on log y) through the live server: each written number's ``value`` and its
    50% / 90% bounds (calibrated and raw) equal in-process `generate`'s, which are exp of the log-scale ones: the
    bounds are positive and bracket the value, wider above it than below (bounds left on log y are loc_Y -+ c
    scale_Y, not exp of them). Softmax mode: the <NUM> bias makes this adapter write numbers there."""
    from causal_adapter.modeling.generation import generate

    prompt = NUMBERS[:-5]
    served = client.completions.create(model="log", prompt=prompt, max_tokens=4,
                                       extra_body={"mode": "softmax"}).choices[0]
    model = local(setup, "log", qwen_tokenizer)
    out = generate(model, prompt, tokenizer=qwen_tokenizer, max_new_tokens=4, mode="softmax")
    assert served.text == out.texts[0]
    numbers = out.numbers[0]
    assert numbers and len(served.values) == len(numbers)
    for v, n in zip(served.values, numbers):
        assert v["text"] == n["text"] and v["value"] == pytest.approx(n["value"], rel=1e-9)
        for level in (50, 90):
            lo, hi = n[f"interval_{level}"]
            c = math.tan(math.pi * level / 200)  # no calibration map: the raw Cauchy interval on log y, exp'd
            assert (lo, hi) == pytest.approx((math.exp(n["loc"] - c * n["scale"]), math.exp(n["loc"] + c * n["scale"])),
                                             rel=1e-9)
            assert 0 < lo < n["exact"] < hi and hi - n["exact"] > n["exact"] - lo  # exp of a symmetric log interval
            assert (v[f"lower_{level}"], v[f"upper_{level}"]) == pytest.approx((lo, hi), rel=1e-9)
            assert (v[f"raw_lower_{level}"], v[f"raw_upper_{level}"]) == pytest.approx(n[f"raw_interval_{level}"],
                                                                                       rel=1e-9)


def test_the_most_logprobs_the_server_allows_are_answered(setup, client, qwen_tokenizer):
    """``logprobs`` at the limit (20, vLLM's default --max-logprobs; 21 is the 400 above) is answered, through the
    openai client: every scored token carries its 20 best alternatives (and its own entry: 20 or 21 texts), each a
    log-probability (<= 0), the chosen token's the value in ``token_logprobs``."""
    from causal_adapter.serving.schemas import MAX_LOGPROBS

    assert MAX_LOGPROBS == 20
    r = client.completions.create(model="num", prompt=NUMBERS[:-5], max_tokens=2, logprobs=MAX_LOGPROBS, echo=True,
                                  extra_body={"mode": "softmax"})
    lp = r.choices[0].logprobs
    assert lp.top_logprobs[0] is None and len(lp.tokens) > 10
    for tok, chosen, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert MAX_LOGPROBS <= len(top) <= MAX_LOGPROBS + 1, (tok, len(top))
        assert top[tok] == chosen and all(v <= 0.0 for v in top.values())


def test_logprobs_of_a_completion_cut_at_a_stop_string_end_with_its_text(setup, client):
    """A completion cut before a stop string carries the logprobs of the tokens it kept: with the stop string the
    text of generated token 3 (the cut on a token boundary), the text is tokens 1-2 and so are its logprobs (the same
    values as without the stop string), not the stop string's token."""
    kw = dict(model="num", prompt=NUMBERS[:-5], max_tokens=6, logprobs=1, temperature=0, extra_body={"mode": "softmax"})
    full = client.completions.create(**kw).choices[0]
    toks = full.logprobs.tokens
    assert len(toks) >= 3 and "".join(toks) == full.text
    stop = toks[2]
    assert stop.strip() and stop not in toks[0] + toks[1] + toks[2][:-1]  # it first occurs where token 3 starts
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == toks[0] + toks[1] and cut.finish_reason == "stop"
    assert cut.logprobs.tokens == toks[:2]
    assert cut.logprobs.token_logprobs == full.logprobs.token_logprobs[:2]
    assert cut.logprobs.text_offset == full.logprobs.text_offset[:2]
