"""`vllm serve --runner pooling` of the folder's values class gives `causal-adapter predict`'s rows (value, scale,
p_num, calibrated 50% / 90% intervals) within 1e-4, for a batch of prompts through the embeddings API, with
tensor_parallel_size=2 (2 CPU processes)."""
from __future__ import annotations

import json

import pytest
from conftest import SUNSPOTS, TP2, VllmServer, cli

from causal_adapter.integrations.vllm.folder import ARCHITECTURES
from causal_adapter.integrations.vllm.pooling import COLUMNS


@pytest.fixture(scope="module")
def server(toy):
    overrides = json.dumps({"architectures": [ARCHITECTURES["qwen2"][1]]})
    s = VllmServer(toy / "out", ["--runner", "pooling", "--hf-overrides", overrides, *TP2], toy / "vllm_values.log")
    yield s.wait_ready()
    s.close()


def test_values_are_predicts(toy, server):
    data = toy / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in SUNSPOTS))
    cli("predict", str(toy / "run" / "adapter"), "--base", str(toy / "base"), "--data-file", str(data),
        "--output", str(toy / "predict.jsonl"))
    expected = [json.loads(line) for line in (toy / "predict.jsonl").read_text().splitlines()]
    got = server.client().embeddings.create(model="causal", input=SUNSPOTS, encoding_format="float").data
    assert len(got) == len(SUNSPOTS)
    for row, e in zip(expected, got):
        assert e.embedding == pytest.approx([row[c] for c in COLUMNS], rel=1e-4, abs=1e-4)
    # the rows differ by prompt (each prompt's numbers reach the head) and the calibrated interval is not the raw one
    assert len({round(r["value"], 3) for r in expected}) == len(expected)
    assert any(r["lower_50"] != r["raw_lower_50"] for r in expected)
