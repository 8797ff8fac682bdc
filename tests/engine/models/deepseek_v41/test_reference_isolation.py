"""The V4.1 model, its formats and hashing import neither nemo nor transformers (test-only
oracles), and neither does the engine that serves it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def test_the_v41_model_and_the_engine_import_without_the_oracles() -> None:
    script = (
        "import sys\n"
        "import deepwell.engine.models.deepseek_v41.cache_formats\n"
        "import deepwell.engine.models.deepseek_v41.engram_hash\n"
        "import deepwell.engine.models.deepseek_v41.model\n"
        "import deepwell.engine.models.deepseek_v41.writer\n"
        "import deepwell.engine.core\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('nemo_automodel', 'transformers')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
