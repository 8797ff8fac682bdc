"""Triton's interpreter runs the kernels on the CPU's tensors. Triton reads the switch when
a kernel is decorated, so it is set before any test module here imports one."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
