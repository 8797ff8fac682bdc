"""Fixtures the layer tests share."""

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The test at one and two torch threads: oneDNN and ATen split work, and on an AMX CPU
    oneDNN picks its kernels, by thread count as well."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
