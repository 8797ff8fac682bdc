"""Build modules without drawing their random initial weights, for a model whose every
parameter the checkpoint then sets (load_weights refuses a checkpoint that leaves one unset)."""

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# What nn.Linear and nn.Embedding draw their weights (and biases) with.
_RANDOM_INITIALISERS = frozenset(
    {torch.nn.init.kaiming_uniform_, torch.nn.init.uniform_, torch.nn.init.normal_}
)


class _SkipRandomInit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_INITIALISERS:
            # torch.nn.init hands the tensor over by keyword.
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def skip_random_init() -> Iterator[None]:
    """Within it (this thread only: a torch function mode), torch.nn.init's random
    initialisers leave their tensor as allocated: uninitialised memory, for load_weights to
    overwrite (or, on the meta device, bind in place). The embedded SmolLM2-135M drew 0.55 s
    of random numbers it never used; on the meta device (DeepSeek-V4.1) nn.Embedding's
    normal_ runs torch._refs, whose first call imports torch._dynamo, ~0.9 s of a process's
    first load. The global random generator is left as it was, too."""
    with _SkipRandomInit():
        yield
