"""Helpers of tests/test_serve.py: small adapters that write numbers, and `causal-adapter serve` in a subprocess
on a free port."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

#: the embedded tiny base every adapter here is made for (the server rebuilds it from the name the adapters record)
TINY = dict(arch="qwen2", hidden_size=32, num_layers=1)
TINY_FLAGS = ["--tiny-hidden-size", "32", "--tiny-layers", "1"]
READY = re.compile(r"ready on (http://\S+?) ")


def tiny_base():
    """The base `load_base(None, "qwen2", "float32", 32, 1)` builds (without loading a tokenizer again)."""
    from causal_adapter.saving.assets import build_tiny_qwen

    return build_tiny_qwen(TINY["arch"], hidden_size=TINY["hidden_size"], num_layers=TINY["num_layers"])


def make_adapter(path: Path, tokenizer, seed: int, value_loc: float, value_scale: float,
                 calibration_rows: int = 200) -> Path:
    """A saved adapter on the tiny base whose deterministic (greedy) text is numbers (heads perturbed as trained
    ones look, a <NUM> bias), with value units and a calibration map (calibrated intervals differ from raw; with
    fewer than 9 calibration rows the calibrated 90% interval is unbounded, as after a short `train`)."""
    from causal_adapter import CausalAdapterConfig, get_causal_model
    from causal_adapter.modeling.intervals import fit_calibration
    from test_generation import perturb

    model = get_causal_model(tiny_base(), CausalAdapterConfig(gamma0=0.3, threshold_init=0.0), tokenizer=tokenizer)
    perturb(model, seed=seed, num_bias=3.5, b_reg=0.0)
    model.set_value_units(value_loc, value_scale, 1)
    n = calibration_rows
    y = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2.0
    model.causal_config.value_calibration = fit_calibration(y, torch.zeros(n), torch.ones(n))
    model.save_pretrained(path)
    return path


class Server:
    """`causal-adapter serve ARGS --port 0` in a subprocess, its output in `log`. It runs torch with as many
    threads as this process (tests/conftest.py): the float sums, hence the values, are the same as in-process."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "OMP_WAIT_POLICY": "PASSIVE",
               "PYTHONUNBUFFERED": "1"}  # passive: idle OpenMP threads sleep, leaving the CPUs to the tests
        self._out = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "causal_adapter", "serve", *args, "--port", "0",
                                      "--log-level", "warning"], stdout=self._out, stderr=subprocess.STDOUT, env=env)
        self.url = None

    def wait_ready(self, timeout: float = 120.0) -> "Server":
        import httpx

        deadline = time.monotonic() + timeout
        while self.url is None:
            m = READY.search(self.log.read_text())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server does not answer /health:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
