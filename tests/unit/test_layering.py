"""The package's layers only look down (docs/design.md).

Every ``import`` in ``src/trainbridge`` (module level or inside a function, ``TYPE_CHECKING`` blocks
included) is parsed with ``ast`` and checked against ``LAYERS``: a module may import its own
package, and packages of a strictly lower layer.  Two packages of the same layer are independent.
Only ``trainbridge/__init__.py`` (the public API) and ``__main__.py`` may import from anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trainbridge

PACKAGE_ROOT = Path(trainbridge.__file__).parent

LAYERS: dict[str, int] = {
    "core": 0,  # config, events, control, context, callback base + manager, distributed seam, errors
    "data": 1,  # samples, plans, loaders, collation, loss
    "modeling": 1,  # what touches a model's internals (padding-free support, varlen attention)
    "parallel": 1,  # training engines: DDP / FSDP2 / DeepSpeed
    "callbacks": 1,  # built-in callbacks (schedule, best checkpoint, metrics file, progress)
    "checkpoint": 2,  # checkpoint folders, rotation, resume state (reads engines)
    "loop": 3,  # the training loop, its build step and its result
    "hf": 4,  # the Hugging Face adapter and porting (plug-ins on the loop)
    "report": 4,  # reports on finished runs read from disk (plots of metrics.jsonl)
    "launch": 5,  # run_training, torchrun worker, transport, callback assembly
    "trainer": 6,  # the transformers.Trainer facade (runs the loop in place or through the launcher)
    "trl": 7,  # trl's trainers and configs on the facade (preference losses, packed log-probs)
    "demos": 7,  # demo and tiny models
    "cli": 8,  # the command line
}
UNRESTRICTED = {"__init__", "__main__"}
LAZY_EXPORTS = {("hf/__init__.py", "trainer")}
"""(module, package) pairs allowed to look up: a package ``__init__`` re-exporting a higher layer's name
through a module ``__getattr__`` (resolved on first use, never at import).  ``trainbridge.hf.Trainer``
is the facade of ``trainbridge.trainer``."""


def _package_of(path: Path, root: Path = PACKAGE_ROOT) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_packages(tree: ast.AST, module_parts: tuple[str, ...]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = list(module_parts[: len(module_parts) - node.level])
                names = [".".join(["trainbridge", *base, *(node.module.split(".") if node.module else [])])]
            elif node.module:
                names = [node.module]
                if node.module == "trainbridge":
                    names = [f"trainbridge.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "trainbridge" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def layering_violations(root: Path = PACKAGE_ROOT) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        here = _package_of(path, root)
        if here in UNRESTRICTED:
            continue
        if here not in LAYERS:
            problems.append(f"{path.relative_to(root)}: package {here!r} has no layer in LAYERS")
            continue
        module_parts = path.relative_to(root).with_suffix("").parts
        for lineno, target in _imported_packages(ast.parse(path.read_text()), module_parts):
            if target == here or (str(path.relative_to(root)), target) in LAZY_EXPORTS:
                continue
            if target not in LAYERS:
                problems.append(f"{path.relative_to(root)}:{lineno} imports trainbridge.{target} (no layer)")
            elif LAYERS[target] >= LAYERS[here]:
                problems.append(
                    f"{path.relative_to(root)}:{lineno}: {here} (layer {LAYERS[here]}) imports "
                    f"{target} (layer {LAYERS[target]}): imports must go to a lower layer"
                )
    return problems


def test_every_import_looks_down() -> None:
    assert layering_violations() == []


def test_every_package_has_a_layer() -> None:
    packages = {_package_of(p) for p in PACKAGE_ROOT.rglob("*.py")} - UNRESTRICTED
    assert packages <= set(LAYERS), packages - set(LAYERS)


@pytest.mark.parametrize(
    ("package", "line"),
    [
        ("core", "from trainbridge.loop.loop import train\n"),
        ("data", "import trainbridge.modeling.padding_free\n"),  # same layer, other package
        ("checkpoint", "def f():\n    from trainbridge.launch import launcher\n"),
        ("loop", "from trainbridge import hf\n"),
    ],
)
def test_an_upward_import_is_caught(tmp_path: Path, package: str, line: str) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / package / "injected.py").write_text(line)
    assert len(layering_violations(tmp_path)) == 1


def test_lazy_exports_are_resolved_lazily() -> None:
    import importlib
    import sys

    for module, _ in LAZY_EXPORTS:
        source = (PACKAGE_ROOT / module).read_text()
        tree = ast.parse(source)
        top_level = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        imported = [getattr(n, "module", "") or "" for n in top_level]
        assert not [m for m in imported if m == "trainbridge.trainer" or m.startswith("trainbridge.trainer.")], module
    sys.modules.pop("trainbridge.trainer", None)
    hf = importlib.import_module("trainbridge.hf")
    from trainbridge.trainer import Trainer

    assert hf.Trainer is Trainer
