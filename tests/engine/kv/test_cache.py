"""KVCache allocation: zeroed, and resident only where written."""

from pathlib import Path

import torch

from deepwell.engine.kv.cache import lazy_zeros

MIB = 1 << 20


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_lazy_zeros_are_zero_in_the_asked_shape_and_dtype():
    tensor = lazy_zeros((3, 5, 7), torch.bfloat16)
    assert tensor.shape == (3, 5, 7) and tensor.dtype == torch.bfloat16
    assert tensor.is_contiguous() and not tensor.any()
    assert lazy_zeros((0, 4), torch.float32).shape == (0, 4)


def test_a_kv_budget_becomes_resident_only_as_blocks_are_written():
    before = resident_bytes()
    tensor = lazy_zeros((512, MIB), torch.uint8)
    allocated = resident_bytes()
    tensor[:64].fill_(1)
    written = resident_bytes()
    assert allocated - before < 32 * MIB  # 512 MiB asked, nothing touched
    assert written - allocated >= 60 * MIB  # the 64 MiB written are now resident
    assert not tensor[64:].any()
