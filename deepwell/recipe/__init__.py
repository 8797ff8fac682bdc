"""How to speak: protocol requests → Conversation → prompt tokens, and tokens → protocol chunks.

Stateless, pure CPU, no torch. Public names mirror deepseek_recipe 0.2.0 (spec/recipe.md §1).
"""

from deepwell.recipe.conversation import (
    AssistantMessage,
    BytesImageSource,
    Conversation,
    DataUrlImageSource,
    ImageSource,
    LatestReminderMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UrlImageSource,
    UserMessage,
)
from deepwell.recipe.encoding.special_tokens import SpecialToken, SpecialTokens
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.options import (
    InferenceOptions,
    ModelVersion,
    OutputConstraint,
    ParsingOptions,
    ThinkingInitialStage,
)
from deepwell.recipe.request import ConversationRequest, ResponsesEcho

# --- encoding (prompt rendering, tokenizer) ---
# isort: split
from deepwell.recipe.encoding.chat_template import ChatTemplateEncoding
from deepwell.recipe.encoding.prompt import RenderedPrompt
from deepwell.recipe.encoding.tokenizer import Tokenizer
from deepwell.recipe.encoding.v4 import DeepseekV4Encoding
from deepwell.recipe.encoding.v41 import DeepseekV41Encoding

# --- dialects (request conversion) ---
# isort: split
from deepwell.recipe.conversion import (
    ConversionOptions,
    ReasoningContentBehavior,
    WebSearchBehavior,
)
from deepwell.recipe.dialects.chat import ChatCompletionRequest
from deepwell.recipe.dialects.messages import MessagesRequest
from deepwell.recipe.dialects.responses import ResponsesRequest

# --- stream (StreamProcessor, chunks, responses) ---
# isort: split
from deepwell.recipe.dialects.chat_output import (
    ChatCompletionChunk,
    ChatCompletionChunkGenerator,
    ChatCompletionResponse,
)
from deepwell.recipe.dialects.messages_output import (
    MessagesChunkGenerator,
    MessagesResponse,
    MessagesStreamEvent,
)
from deepwell.recipe.dialects.responses_output import (
    ResponsesChunkGenerator,
    ResponsesResponse,
    ResponsesStreamEvent,
)
from deepwell.recipe.stream.chunks import InferenceChunk, InferenceFinishReason, PromptUsage
from deepwell.recipe.stream.processor import StreamProcessor

__version__ = "0.2.0"
