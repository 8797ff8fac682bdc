import logging
import sys

import pytest

from deepwell.engine.layers.triton import KernelSetError, log_kernel_set, require_triton


def test_require_triton_returns_the_installed_module():
    assert require_triton().__version__ == "3.9.0"


def test_missing_triton_is_an_error_naming_the_pin_and_the_way_out(monkeypatch):
    # A None entry in sys.modules makes `import triton` fail as if it were not installed.
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(KernelSetError, match=r"pip install triton==3\.9\.0.*--kernels auto"):
        require_triton()
    with pytest.raises(ValueError):
        log_kernel_set("triton")


def test_triton_on_cpu_tensors_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelSetError, match="TRITON_INTERPRET=1"):
        log_kernel_set("triton", "cpu")
    log_kernel_set("triton", "cuda")


def test_the_kernel_set_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="deepwell.engine.layers.triton"):
        log_kernel_set("triton")
        log_kernel_set("auto")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "kernel set: triton",
        "kernel set: auto",
    ]
