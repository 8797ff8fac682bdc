"""The engine: token ids in, token ids out; paged KV, continuous batching, sampling.

Never imports `deepwell.recipe` or `deepwell.serve`.
"""

from deepwell.engine.args import EngineArgs
from deepwell.engine.core import EngineCore, EngineStats
from deepwell.engine.errors import (
    EngineError,
    InvalidRequestError,
    MemoryBudgetError,
    ModelLoadError,
)
from deepwell.engine.llm import LLM
from deepwell.engine.outputs import Completion, FinishReason, RequestOutput, TokenLogprobs
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.stream import AsyncEngine
from deepwell.engine.structured import GrammarError, StructuredOutput
