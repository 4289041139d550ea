"""lm-evaluation-harness on a causal adapter (docs/evaluate.md), with the real harness (the eval extra), a real
server and nothing mocked. The harness's own ``hf`` model on a float64 tiny base saved to disk is the reference: at
initialisation, on text without numbers, ``--model causal_adapter`` in-process and ``--model local-completions``
against `causal-adapter serve` give its per-request log-likelihoods to 1e-9 (multiple choice, rolling windows, a
request truncated to max_length). With numbers (a trained-looking adapter), in-process and the server agree, and
both equal log p(<NUM>) + log P(the value rounds to the written text) computed from the model's forward."""
import math

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra: pip install 'causal_adapter[eval]'")
pytest.importorskip("tenacity", reason="lm-eval's API models: pip install 'causal_adapter[eval]'")
pytest.importorskip("fastapi", reason="the serve extra: pip install 'causal_adapter[serve]'")

from pathlib import Path  # noqa: E402

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from causal_adapter import CausalModel  # noqa: E402
from causal_adapter.integrations.lm_eval_harness import lm_class, register  # noqa: E402
from causal_adapter.numbers import NumberTokenizer  # noqa: E402
from serve_fixtures import Server  # noqa: E402
from test_serve_logprobs import float64_base_and_adapters, reference  # noqa: E402

TASKS = str(Path(__file__).parent / "data" / "lm_eval")
LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. " * 2


@pytest.fixture(scope="module")
def env(tmp_path_factory, qwen_tokenizer):
    d = tmp_path_factory.mktemp("lm_eval")
    base = float64_base_and_adapters(d, qwen_tokenizer)
    server = Server(["--base", str(d / "base"), "--dtype", "float64", "--adapter", f"fresh={d / 'fresh'}",
                     "--adapter", f"num={d / 'num'}"], d / "serve.log")
    register()
    try:
        yield {"dir": d, "base": base, "url": server.wait_ready().url, "tasks": TaskManager(include_path=TASKS)}
    finally:
        server.stop()


def evaluate(env, model, model_args, task, limit=None):
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=env["tasks"],
                                  log_samples=True, batch_size=3, limit=limit)
    return [s["resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


def hf_args(env, **extra):
    return ",".join([f"pretrained={env['dir'] / 'base'}", "dtype=float64", "device=cpu",
                     *(f"{k}={v}" for k, v in extra.items())])


def ours_args(env, adapter=None, **extra):
    args = [f"base={env['dir'] / 'base'}", "dtype=float64"] + ([f"adapter={env['dir'] / adapter}"] if adapter else [])
    return ",".join(args + [f"{k}={v}" for k, v in extra.items()])


def server_args(env, adapter):
    return (f"model={adapter},base_url={env['url']}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={env['dir'] / 'base'},max_length=2048")


def lls(resps):
    return [lp for doc in resps for ((lp, _),) in doc]


@pytest.fixture(scope="module")
def hf_text(env):
    return lls(evaluate(env, "hf", hf_args(env), "causal_text_mc", limit=5))


def test_in_process_equals_the_hf_model_at_initialisation(env, hf_text):
    ours = lls(evaluate(env, "causal_adapter", ours_args(env), "causal_text_mc", limit=5))
    assert len(ours) == len(hf_text) == 15
    assert ours == pytest.approx(hf_text, abs=1e-9, rel=0)


def test_the_server_equals_the_hf_model_at_initialisation(env, hf_text):
    served = lls(evaluate(env, "local-completions", server_args(env, "fresh"), "causal_text_mc", limit=5))
    assert served == pytest.approx(hf_text, abs=1e-9, rel=0)


def test_rolling_and_truncated_requests_equal_the_hf_models(env):
    """loglikelihood_rolling (disjoint windows of max_length) and a context left-truncated to max_length, as the hf
    model does both; a continuation longer than max_length is an error."""
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(env["dir"] / "base"), dtype="float64", device="cpu", max_length=12, batch_size=2)
    ours = lm_class()(base=str(env["dir"] / "base"), dtype="float64", max_length=12, batch_size=2)
    rolling = [Instance("loglikelihood_rolling", {}, (LONG,), 0), Instance("loglikelihood_rolling", {}, ("Hi",), 1)]
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(hf.loglikelihood_rolling(rolling), abs=1e-9, rel=0)
    reqs = [Instance("loglikelihood", {}, (LONG, " the end"), 0), Instance("loglikelihood", {}, ("", "Hello there"), 1)]
    assert [x for x, _ in ours.loglikelihood(reqs)] == pytest.approx([x for x, _ in hf.loglikelihood(reqs)],
                                                                       abs=1e-9, rel=0)
    with pytest.raises(ValueError, match="longer than the model's max_length 12"):
        ours.loglikelihood([Instance("loglikelihood", {}, ("A", LONG), 0)])


def test_numbers_score_log_p_num_plus_the_written_interval(env, qwen_tokenizer):
    ours = evaluate(env, "causal_adapter", ours_args(env, "num"), "causal_numbers_mc", limit=3)
    served = evaluate(env, "local-completions", server_args(env, "num"), "causal_numbers_mc", limit=3)
    assert lls(served) == pytest.approx(lls(ours), abs=1e-8, rel=0)
    model = CausalModel.from_pretrained(env["base"], env["dir"] / "num", tokenizer=qwen_tokenizer).eval()
    ntok = NumberTokenizer(qwen_tokenizer, model.num_token_id)
    question = "Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971:"
    for choice, ((lp, _),) in zip([" 66.6", " 660", " 6.6"], ours[0]):
        want = reference(model, ntok, question + choice)[-2:]  # " " then the number
        assert lp == pytest.approx(sum(want), abs=1e-9, rel=0)
    # the choices differ by their values only: a probability each, not a density (" 660" has the widest interval)
    assert not math.isclose(lls(ours)[0], lls(ours)[1])


def test_a_number_across_the_context_boundary_is_scored_whole(env):
    lm = lm_class()(base=str(env["dir"] / "base"), dtype="float64")
    (ids, _, texts), start = lm.encode_pair("The answer is 4", "2")
    assert ids[start:] == [lm.model.num_token_id] and texts[start] == "42"
    (ids, _, texts), start = lm.encode_pair("The answer is", " 42 apples")
    assert texts[start:start + 2] == [None, "42"] and len(ids) - start == 3


def test_the_generation_task_runs_greedy_under_the_mode(env, qwen_tokenizer):
    resps = evaluate(env, "causal_adapter", ours_args(env, "num"), "causal_numbers_gen", limit=1)
    model = CausalModel.from_pretrained(env["base"], env["dir"] / "num", tokenizer=qwen_tokenizer).eval()
    prompt = "Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971:"
    want = model.generate(prompt, tokenizer=qwen_tokenizer, mode="softmax", max_new_tokens=8).texts[0].split("\n")[0]
    assert resps[0] == [[want]] and want
