"""The package's layers only look down (docs/design.md).

Every ``import`` in ``src/trainbridge`` (module level or inside a function, ``TYPE_CHECKING`` blocks
included) is parsed with ``ast`` and checked against ``LAYERS``: a module may import its own
package, and packages of a strictly lower layer.  Two packages of the same layer are independent.
``import trainbridge`` and ``from trainbridge import X`` count too: ``X`` is the package that defines it (the
export table), the bare package the highest layer it exports from.  Only ``trainbridge/__init__.py`` (the
public API) and ``__main__.py`` may import from anywhere.  The public API and design.md's import table are
checked against the code here as well.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

import trainbridge

PACKAGE_ROOT = Path(trainbridge.__file__).parent
DESIGN = PACKAGE_ROOT.parents[1] / "docs" / "design.md"

LAYERS: dict[str, int] = {
    "core": 0,  # config, events, control, context, callback base + manager, distributed seam, errors
    "data": 1,  # samples, plans, loaders, collation, loss
    "modeling": 1,  # what touches a model's internals (padding-free support, varlen attention)
    "parallel": 1,  # training engines: DDP / FSDP2 / DeepSpeed
    "callbacks": 1,  # built-in callbacks (schedule, best checkpoint, metrics file, progress)
    "checkpoint": 2,  # checkpoint folders, rotation, resume state (reads engines)
    "step": 2,  # the training step as a seam: batches and loss per task (token cross entropy, model's own loss)
    "loop": 3,  # the training loop, its build step and its result
    "hf": 4,  # HuggingFaceCallbacks, TrainerState and porting (plug-ins on the loop)
    "report": 4,  # reports on finished runs read from disk (plots of metrics.jsonl)
    "launch": 5,  # run_training, torchrun worker, transport, callback assembly
    "trainer": 6,  # the transformers.Trainer facade (runs the loop in place or through the launcher)
    "instructlab": 6,  # instructlab-training's names (from trainbridge.instructlab import ...)
    "trl": 7,  # trl's trainers and configs on the facade (preference losses, packed log-probs)
    "demos": 7,  # demo and tiny models
    "cli": 8,  # the command line
}
UNRESTRICTED = {"__init__", "__main__"}
PUBLIC_API = "trainbridge"  # the target recorded for a bare ``import trainbridge``


def _package_of(path: Path, root: Path = PACKAGE_ROOT) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@functools.cache
def _export_table() -> dict[str, str]:
    """``trainbridge._EXPORTS`` as written in ``__init__.py`` (public name -> defining module)."""
    tree = ast.parse((PACKAGE_ROOT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "_EXPORTS":
            assert node.value is not None
            return ast.literal_eval(node.value)
    raise AssertionError("trainbridge/__init__.py has no _EXPORTS table")


def _layer(target: str) -> int:
    """The layer of an import target: a package, or the public API (the highest layer it exports from)."""
    if target == PUBLIC_API:
        return max(LAYERS[module.split(".")[1]] for module in _export_table().values())
    return LAYERS[target]


def _imported_packages(tree: ast.AST, module_parts: tuple[str, ...]) -> list[tuple[int, str]]:
    exports = _export_table()
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = list(module_parts[: len(module_parts) - node.level])
                names = [".".join(["trainbridge", *base, *(node.module.split(".") if node.module else [])])]
            elif node.module == "trainbridge":  # a public name: where it is defined; else a subpackage
                names = [exports.get(alias.name, f"trainbridge.{alias.name}") for alias in node.names]
                names = [PUBLIC_API if name.startswith("trainbridge.__") else name for name in names]
            elif node.module:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "trainbridge":
                found.append((node.lineno, parts[1] if len(parts) > 1 else PUBLIC_API))
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
            if target == here:
                continue
            if target != PUBLIC_API and target not in LAYERS:
                problems.append(f"{path.relative_to(root)}:{lineno} imports trainbridge.{target} (no layer)")
            elif _layer(target) >= LAYERS[here]:
                problems.append(
                    f"{path.relative_to(root)}:{lineno}: {here} (layer {LAYERS[here]}) imports "
                    f"{target} (layer {_layer(target)}): imports must go to a lower layer"
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
        ("demos", "import trainbridge\n"),  # the public API re-exports trl's trainer (layer 7)
        ("core", "from trainbridge import TrainingArgs, Trainer\n"),  # Trainer: trainbridge.trainer
        ("data", "from trainbridge import __version__\n"),
    ],
)
def test_an_upward_import_is_caught(tmp_path: Path, package: str, line: str) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / package / "injected.py").write_text(line)
    assert len(layering_violations(tmp_path)) == 1


def test_a_public_name_from_a_lower_layer_is_allowed(tmp_path: Path) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / "data" / "injected.py").write_text("from trainbridge import TrainingArgs\n")  # core
    (tmp_path / "cli" / "injected.py").write_text("import trainbridge\n")
    assert layering_violations(tmp_path) == []


# ------------------------------------------------------------------------------------------ the public API
def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse((PACKAGE_ROOT / "__init__.py").read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    imported = {}
    for node in block.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                assert alias.asname in (None, alias.name), ast.unparse(node)
                imported[alias.name] = str(node.module)
    return imported


def test_the_type_checking_imports_match_the_export_table() -> None:
    assert _type_checking_imports() == _export_table()  # e.g. a name exported but not type-checked


def test_every_public_name_resolves_where_the_table_says() -> None:
    import importlib

    exports = _export_table()
    assert trainbridge.__all__ == [*exports, "__version__"]
    # at most 25: the core API plus one drop-in per ported Trainer (transformers and trl), so a script ports
    # by changing one import
    assert 12 <= len(exports) <= 25, "keep the top-level surface small; add names to a submodule instead"
    for name, module in exports.items():
        assert getattr(trainbridge, name) is getattr(importlib.import_module(module), name), name


def test_the_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import version

    assert trainbridge.__version__ == version("trainbridge")
    assert "__version__ =" not in (PACKAGE_ROOT / "__init__.py").read_text()


def test_instructlab_names_port_by_changing_the_module() -> None:
    from trainbridge import instructlab
    from trainbridge.core import config, instructlab_names
    from trainbridge.launch import launcher

    assert instructlab.TrainingArgs is config.TrainingArgs and instructlab.TorchrunArgs is config.TorchrunArgs
    assert instructlab.run_training is launcher.run_training
    assert instructlab.LoraOptions is instructlab_names.LoraOptions
    assert instructlab.DeepSpeedOptions is instructlab_names.DeepSpeedOptions
    assert set(instructlab.__all__) == {n for n in vars(instructlab) if not n.startswith("_")} - {"annotations"}


# ------------------------------------------------------------------------------- design.md's import table
def code_imports(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Per package, the other packages it imports (the public API counted as ``trainbridge``)."""
    found: dict[str, set[str]] = {name: set() for name in LAYERS}
    for path in sorted(root.rglob("*.py")):
        here = _package_of(path, root)
        if here in UNRESTRICTED:
            continue
        module_parts = path.relative_to(root).with_suffix("").parts
        found[here] |= {t for _, t in _imported_packages(ast.parse(path.read_text()), module_parts) if t != here}
    return found


def design_imports() -> dict[str, set[str]]:
    """docs/design.md's "What each folder imports" table: ``| folder | a, b (note) |`` rows."""
    text = DESIGN.read_text()
    table = text[text.index("What each folder imports") :].split("\n\n")[1]
    rows: dict[str, set[str]] = {}
    for line in table.splitlines()[2:]:
        folders, imports = (cell.strip() for cell in line.strip("|").split("|"))
        imports = re.sub(r"\(.*?\)", "", imports).strip()
        names = set() if imports.startswith("nothing") else {n.strip() for n in imports.split(",")}
        for folder in folders.split(","):
            rows[folder.strip()] = names
    return rows


def test_the_design_import_table_matches_the_code() -> None:
    assert design_imports() == code_imports()
