"""Memory sizes as people write them."""

import pytest

from deepwell.engine.plan.sizes import human, parse_size

GIB = 1 << 30


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1TiB", 1 << 40),
        ("256GiB", 256 * GIB),
        ("512G", 512 * GIB),
        ("1.5T", int(1.5 * (1 << 40))),
        ("64gb", 64 * GIB),
        ("48", 48 * GIB),
        ("0.5", GIB // 2),
        ("100 MiB", 100 << 20),
    ],
)
def test_sizes_in_binary_units_and_plain_gib(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "1PB", "-4G", "0", "1..5G"])
def test_unreadable_sizes_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_size(text)


def test_sizes_print_in_the_largest_unit() -> None:
    assert human(510_286_023_000) == "475.24 GiB"
    assert human(1 << 40) == "1.00 TiB"
    assert human(3_128_376) == "2.98 MiB"
    assert human(24) == "24 B"
