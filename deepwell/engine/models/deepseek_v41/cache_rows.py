"""The bytes of one row in each of DeepSeek-V4.1's cache formats (spec §3.7), torch-free:
the cache codecs (cache_formats.py) pack to them and the planner (engine/plan/) counts them."""

FP8_GROUP = 32
NVFP4_GROUP = 16
MXFP4_GROUP = 32


def fp8_row_bytes(channels: int) -> int:
    """fp8 e4m3 codes and a UE8M0 scale per 32 (a 512-wide window row: 528 B)."""
    return channels + _groups(channels, FP8_GROUP)


def nvfp4_row_bytes(channels: int) -> int:
    """e2m1 code pairs and an e4m3 scale per 16 (a 512-wide compressed entry: 288 B)."""
    return _groups(channels, 2) + _groups(channels, NVFP4_GROUP)


def mxfp4_row_bytes(channels: int) -> int:
    """e2m1 code pairs and a UE8M0 scale per 32 (a 128-wide index key: 68 B)."""
    return _groups(channels, 2) + _groups(channels, MXFP4_GROUP)


def _groups(channels: int, group: int) -> int:
    return -(-channels // group)
