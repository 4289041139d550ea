"""The package's layers (docs/architecture.md): no import from a lower layer up to a higher one and no
import cycle, counting imports made inside functions."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "causal_adapter"
# bottom to top; a module may import its own layer and the ones below
LAYERS = {"_version": 0, "_compat": 0, "config": 0, "numbers": 1, "number_grammar": 1, "records": 1, "modeling": 2, "saving": 3, "model": 4, "data": 5,
          "training": 6, "serving": 7, "commands": 8, "integrations": 8,
          "__main__": 9}
# old import paths kept for users (CHANGELOG), each a module that only re-exports from its new home (none since
# saving/model.py, the one upward import, was removed: CHANGELOG.md)
ALIASES: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported module under the package, line, inside a function) for every import of our own modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            targets = []
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[:len(package) - child.level + 1] if child.level > 1 else package
                    mod = ".".join(base + ([child.module] if child.module else []))
                    targets = [mod] + [f"{mod}.{a.name}".strip(".") for a in child.names]
                elif child.module and child.module.startswith("causal_adapter"):
                    mod = child.module[len("causal_adapter"):].lstrip(".")
                    targets = [mod] + [f"{mod}.{a.name}".strip(".") for a in child.names]
            elif isinstance(child, ast.Import):
                targets = [a.name[len("causal_adapter"):].lstrip(".") for a in child.names
                           if a.name.startswith("causal_adapter.")]
            for t in targets:
                found.append((t, child.lineno, nested))
            visit(child, nested)
    visit(tree, False)
    return found


def _layer(module: str) -> int | None:
    return LAYERS.get(module.split(".")[0]) if module else None


def _edges() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        if path.name == "__init__.py":  # re-exports of a package are not dependencies of its modules
            continue
        for target, _, _ in _imports(m, path):
            if target in mods and target != m and mods[target].name != "__init__.py":
                edges[m].add(target)
    return edges


def test_every_module_has_a_layer():
    for m in _modules():
        if m:
            assert _layer(m) is not None, f"causal_adapter.{m} is in no layer of docs/architecture.md"


def test_no_import_goes_up_a_layer():
    mods = _modules()
    up = []
    for m, path in mods.items():
        if not m or path.name == "__init__.py" and "." not in m:
            continue  # the package's __init__ is the public surface: it may import any layer
        for target, line, _ in _imports(m, path):
            if m in ALIASES and target.split(".")[0] == ALIASES[m]:
                continue  # an old import path re-exporting from the new home (test_aliases_only_re_export)
            if target in mods and _layer(target) is not None and _layer(target) > _layer(m):
                up.append(f"causal_adapter/{path.relative_to(PACKAGE)}:{line} imports {target}")
    assert not up, "imports from a lower layer up to a higher one:\n" + "\n".join(up)


def test_aliases_only_re_export():
    """An old import path is an alias, nothing more: its body is imports from the new home (and a docstring)."""
    mods = _modules()
    for alias, home in ALIASES.items():
        tree = ast.parse(mods[alias].read_text(encoding="utf-8"))
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        assert body and all(isinstance(n, ast.ImportFrom) for n in body), f"{alias} holds more than imports"
        assert {t.split(".")[0] for t, _, _ in _imports(alias, mods[alias])} == {home}, alias


def test_no_import_cycle():
    edges, cycles, state = _edges(), [], {}

    def dfs(v, stack):
        state[v] = 1
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                cycles.append(" -> ".join(stack[stack.index(w):] + [w]))
            elif w not in state:
                dfs(w, stack + [w])
        state[v] = 2
    for v in sorted(edges):
        if v not in state:
            dfs(v, [v])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layer_checks_catch_an_upward_import(tmp_path, monkeypatch):
    """The checks above are not vacuous: an import from modeling up to training is reported."""
    fake = tmp_path / "causal_adapter"
    (fake / "modeling").mkdir(parents=True)
    (fake / "training").mkdir()
    for p in ("__init__.py", "modeling/__init__.py", "training/__init__.py", "training/loop.py"):
        (fake / p).write_text("")
    (fake / "modeling" / "heads.py").write_text("def f():\n    from ..training.loop import train\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    with pytest.raises(AssertionError, match="modeling/heads.py:2 imports training.loop"):
        test_no_import_goes_up_a_layer()


def _stated_layer(docstring: str | None) -> int | None:
    """The N of a docstring that opens with ``Layer N``."""
    match = re.match(r"Layer (\d+)\b", docstring or "")
    return int(match.group(1)) if match else None


def _table_layers() -> dict[str, int]:
    """{package or module: layer} from docs/architecture.md's layer table (``| 2 | `modeling/` | ...``)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    return {name.strip("/").removesuffix(".py"): int(n)
            for n, name in re.findall(r"^\| (\d+) \| `([^`]+)`", text, flags=re.MULTILINE)}


def test_the_stated_layers_are_the_declared_ones():
    """Every subpackage's docstring opens with its layer, and that number, docs/architecture.md's table and LAYERS
    agree (a package moved without its docstring or the table, and the numbers drift apart)."""
    stated = {}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        stated[init.parent.name] = _stated_layer(ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))))
    assert stated and None not in stated.values(), f"a subpackage's docstring does not open with 'Layer N': {stated}"
    wrong = {name: (n, LAYERS[name]) for name, n in stated.items() if n != LAYERS[name]}
    assert not wrong, f"docstring layer != declared layer (stated, declared): {wrong}"
    table = _table_layers()
    assert set(stated) <= set(table), f"packages missing from docs/architecture.md's table: {set(stated) - set(table)}"
    wrong = {name: (n, LAYERS[name]) for name, n in table.items() if n != LAYERS.get(name)}
    assert not wrong, f"docs/architecture.md's layer != declared layer (table, declared): {wrong}"


def test_the_stated_layer_check_catches_a_stale_number(tmp_path, monkeypatch):
    """Not vacuous: a subpackage whose docstring says another layer is reported."""
    fake = tmp_path / "causal_adapter"
    (fake / "data").mkdir(parents=True)
    (fake / "data" / "__init__.py").write_text('"""Layer 4, data: stale."""\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    monkeypatch.setattr(sys.modules[__name__], "_table_layers", lambda: {"data": 5})
    with pytest.raises(AssertionError, match=r"'data': \(4, 5\)"):
        test_the_stated_layers_are_the_declared_ones()


def test_docs_architecture_names_every_module():
    """docs/architecture.md's table names every module of the package (its file, or its name in its package's
    row): a module added without a word on what it owns fails here."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        name = path.stem
        if f"`{name}.py`" not in table and f"`{name}`" not in table and f"`{name}/`" not in table \
                and f"{path.parent.name}/{name}" not in table:
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"modules docs/architecture.md does not name: {missing}"


def test_integrations_need_nothing_of_the_command_line():
    """The commands run the integrations (`commands/harness.py`: lm-eval), never the other way: an integration is
    usable from Python without the CLI (its base check lives in `saving/hub.py`)."""
    up = [(m, target, line) for m, path in _modules().items() if m.startswith("integrations")
          for target, line, _ in _imports(m, path) if target.split(".")[0] == "commands"]
    assert not up, f"integrations importing the command line: {up}"
