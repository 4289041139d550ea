"""The flat module names of causal_adapter < 0.5 (`causal_adapter.train`, `causal_adapter.model`, ...) as
aliases of the modules that hold that code now: `import causal_adapter.train` gives the module object of
`causal_adapter.training.loop` itself, so attribute lookups and monkeypatches reach the real code (a
re-exporting shim would be a second object, and patching it would patch nothing).
`python -m causal_adapter.train` (and .cli, .corpora) still runs the command."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "cauchy": "modeling.cauchy",
    "heads": "modeling.heads",
    "loss": "modeling.loss",
    "scoring": "modeling.scoring",
    "families": "modeling.families",
    "intervals": "modeling.intervals",
    "generation": "modeling.generation",
    "prediction": "modeling.prediction",
    "verify": "modeling.verify",
    "model": "saving.model",
    "artifacts": "saving.artifacts",
    "assets": "saving.assets",
    "integrations": "saving.integrations",
    "hf_trainer": "saving.hf_trainer",
    "corpora": "data.corpora",
    "train_config": "training.config",
    "train": "training.loop",
    "checkpoints": "training.checkpoints",
    "value_fit": "training.value_fit",
    "metrics": "training.metrics",
    "plotting": "training.plotting",
    "evaluate": "training.evaluate",
    "demo": "training.demo",
    "cli": "commands.main",
    "predict_command": "commands.predict",
}
# `python -m <old>` runs the command that module used to run
MAIN = {"train": "commands.train", "cli": "commands.main", "corpora": "commands.data"}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str) -> None:
        self.package = package

    def _target(self, fullname: str, table: dict) -> str | None:
        head, _, name = fullname.rpartition(".")
        return f"{self.package}.{table[name]}" if head == self.package and name in table else None

    def find_spec(self, fullname, path=None, target=None):
        if self._target(fullname, MOVED) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        # importlib returns what sys.modules holds after exec_module: the moved module itself
        sys.modules[module.__name__] = importlib.import_module(self._target(module.__name__, MOVED))

    def get_code(self, fullname: str):  # runpy (python -m OLD): run the command that module ran
        target = self._target(fullname, MAIN)
        if target is None:
            return None
        return compile(f"import sys\nfrom {target} import main\nsys.exit(main())\n", f"<{fullname}>", "exec")


def install(package: str) -> None:
    if not any(isinstance(f, _Alias) and f.package == package for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias(package))  # before the path finders: an old .py left behind loses
