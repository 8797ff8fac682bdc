"""Row bytes of the released cache formats (spec §3.7), which the planner and the codecs share."""

from deepwell.engine.models.deepseek_v41.cache_rows import (
    fp8_row_bytes,
    mxfp4_row_bytes,
    nvfp4_row_bytes,
)


def test_cache_entries_take_their_released_bytes() -> None:
    # spec §3.7: fp8 window rows 528 B, nvfp4 compressed entries 288 B, mxfp4 index keys 68 B
    assert fp8_row_bytes(512) == 528
    assert nvfp4_row_bytes(512) == 288
    assert mxfp4_row_bytes(128) == 68
