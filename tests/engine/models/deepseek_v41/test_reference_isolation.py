"""The V4.1 formats and hashing import neither nemo nor transformers (test-only oracles)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def test_cache_formats_and_engram_hash_import_without_the_oracles() -> None:
    script = (
        "import sys\n"
        "import deepwell.engine.models.deepseek_v41.cache_formats\n"
        "import deepwell.engine.models.deepseek_v41.engram_hash\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('nemo_automodel', 'transformers')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
