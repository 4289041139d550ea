"""`vllm serve` of an exported folder writes the tokens `causal-adapter generate` writes (softmax mode, greedy)."""
from __future__ import annotations

import json

import pytest
from conftest import SUNSPOTS, TEXTS, VllmServer, cli

from causal_adapter.integrations.vllm.tokenizer import NUM_TEXT

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(toy):
    s = VllmServer(toy / "out", [], toy / "vllm_text.log").wait_ready()
    yield s
    s.close()


def ours(toy, mode: str, prompts: list[str]) -> list[dict]:
    out = toy / f"generate_{mode}.jsonl"
    cli("generate", *prompts, "--base", str(toy / "base"), "--adapter", str(toy / "run" / "adapter"), "--mode", mode,
        "--max-new-tokens", str(MAX_TOKENS), "--no-progress", "--output", str(out))
    return [json.loads(line) for line in out.read_text().splitlines()]


def same_text(vllm_text: str, row: dict) -> bool:
    """vLLM's completion is ours up to the first number ours writes; there vLLM writes NUM_TEXT (the value of a number
    the engine generates does not reach its detokenizer), without the " " our number layout writes before a number
    chosen after another token (docs/serve_at_scale.md#limits: both limits)."""
    if not row["values"]:
        return vllm_text == row["completion"]
    head = row["completion"][:row["completion"].index(row["values"][0]["text"])]
    return vllm_text.startswith(head + NUM_TEXT) or (head.endswith(" ") and vllm_text.startswith(head[:-1] + NUM_TEXT))


def assert_completions_are_ours(toy, server, mode: str) -> list[dict]:
    """Greedy completions of SUNSPOTS + TEXTS through the OpenAI client equal `generate --mode MODE`'s; ours returned."""
    prompts = SUNSPOTS + TEXTS
    client = server.client()
    got = [client.completions.create(model="causal", prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
           for p in prompts]
    rows = ours(toy, mode, prompts)
    assert [same_text(g, r) for g, r in zip(got, rows)] == [True] * len(prompts), (got, [r["completion"] for r in rows])
    assert len(set(got)) > 1  # the prompts lead to different texts: the comparison reads each one's own
    return rows


def test_softmax_completions_are_ours(toy, server):
    assert_completions_are_ours(toy, server, "softmax")


def test_the_prompt_numbers_enter_as_value_ids(server):
    """vLLM tokenizes a prompt through the tokenizer mode: one id per number, decoded back to the number."""
    import urllib.request

    body = json.dumps({"model": "causal", "prompt": SUNSPOTS[0]}).encode()
    req = urllib.request.Request(server.url + "/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        tokens = json.loads(r.read())["tokens"]
    from causal_adapter.integrations.vllm.value_ids import is_value_id, value_of_id

    assert [value_of_id(t) for t in tokens if is_value_id(t)] == pytest.approx([1969, 105.5, 1970, 104.5, 1971, 66.6,
                                                                                1972], rel=1e-7)
