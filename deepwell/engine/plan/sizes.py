"""Memory sizes as people write them ("1TiB", "512G", "1.5T", plain GiB) and as we print them."""

from __future__ import annotations

import re

GIB = 1 << 30
# Binary units throughout: "G" and "GB" mean GiB, as in `free -g` and the engine's --memory-gib.
_UNITS = {"": GIB, "k": 1 << 10, "m": 1 << 20, "g": GIB, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes for "1TiB", "256GiB", "512G", "1.5T", "64gb" or a plain number of GiB."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(
            f"cannot read {text!r} as a memory size: write e.g. 1TiB, 256GiB, 512G, 1.5T "
            "or a plain number of GiB"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return int(value)


def human(size: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1: "2.98 MiB"."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:g} B"
