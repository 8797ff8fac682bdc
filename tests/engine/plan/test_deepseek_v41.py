"""The V4.1 footprint follows the engine's own cache layout and released cache formats."""

from deepwell.engine.models.deepseek_v41.model import MAX_BACKTRACK
from deepwell.engine.plan.deepseek_v41 import (
    ROLLBACK_ROWS,
    compressed_entry_bytes,
    index_key_bytes,
    window_row_bytes,
)


def test_the_rings_keep_the_models_rollback_rows() -> None:
    assert ROLLBACK_ROWS == MAX_BACKTRACK


def test_cache_entries_take_their_released_bytes() -> None:
    # spec §3.7: fp8 window rows 528 B, nvfp4 compressed entries 288 B, mxfp4 index keys 68 B
    assert window_row_bytes(512) == 528
    assert compressed_entry_bytes(512) == 288
    assert index_key_bytes(128) == 68
