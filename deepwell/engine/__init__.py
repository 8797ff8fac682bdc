"""The engine: token ids in, token ids out; paged KV, continuous batching, sampling.

Never imports `deepwell.recipe` or `deepwell.serve`. Its names load on first use, so that the
torch-free parts (errors, the memory planner, the checkpoint schema) import without torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepwell.engine.args import EngineArgs
    from deepwell.engine.core import EngineCore
    from deepwell.engine.errors import (
        EngineError,
        InvalidRequestError,
        MemoryBudgetError,
        ModelLoadError,
    )
    from deepwell.engine.llm import LLM
    from deepwell.engine.outputs import Completion, FinishReason, RequestOutput, TokenLogprobs
    from deepwell.engine.sampling_params import SamplingParams
    from deepwell.engine.stats import EngineStats
    from deepwell.engine.stream import AsyncEngine
    from deepwell.engine.structured import GrammarError, StructuredOutput

# Public name → the module that defines it.
_EXPORTS = {
    "EngineArgs": "deepwell.engine.args",
    "EngineCore": "deepwell.engine.core",
    "EngineStats": "deepwell.engine.stats",
    "EngineError": "deepwell.engine.errors",
    "InvalidRequestError": "deepwell.engine.errors",
    "MemoryBudgetError": "deepwell.engine.errors",
    "ModelLoadError": "deepwell.engine.errors",
    "LLM": "deepwell.engine.llm",
    "Completion": "deepwell.engine.outputs",
    "FinishReason": "deepwell.engine.outputs",
    "RequestOutput": "deepwell.engine.outputs",
    "TokenLogprobs": "deepwell.engine.outputs",
    "SamplingParams": "deepwell.engine.sampling_params",
    "AsyncEngine": "deepwell.engine.stream",
    "GrammarError": "deepwell.engine.structured",
    "StructuredOutput": "deepwell.engine.structured",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepwell.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
