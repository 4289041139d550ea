"""A folder exported with `--decision deterministic`, served with tensor_parallel_size=2 (2 CPU processes, each scoring
its half of the vocabulary): greedy completions are `generate --mode deterministic`'s (the argmax of the OvR
probability), which differ from softmax mode's on these prompts."""
from __future__ import annotations

import pytest
from conftest import SUNSPOTS, TEXTS, TP2, VllmServer, cli
from test_text import assert_completions_are_ours, ours


@pytest.fixture(scope="module")
def server(toy):
    cli("export-vllm", str(toy / "run" / "adapter"), str(toy / "out_det"), "--decision", "deterministic")
    s = VllmServer(toy / "out_det", TP2, toy / "vllm_det.log").wait_ready()
    yield s
    s.close()


def test_deterministic_completions_are_ours(toy, server):
    rows = assert_completions_are_ours(toy, server, "deterministic")
    softmax = [r["completion"] for r in ours(toy, "softmax", SUNSPOTS + TEXTS)]
    assert softmax != [r["completion"] for r in rows]  # the decision is the folder's, not softmax's by accident
