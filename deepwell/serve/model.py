"""What the HTTP process knows about the served model: names, encoding, tokenizer, context.

The model's metadata picks the encoding: DeepSeek V4 / V4.1 for DeepSeek models, ChatML for
models whose chat template is ChatML (the embedded SmolLM2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from deepwell.recipe import (
    ChatMLEncoding,
    Conversation,
    ConversionOptions,
    DeepseekV4Encoding,
    DeepseekV41Encoding,
    ModelVersion,
    Tokenizer,
    ToolDefinition,
)
from deepwell.serve.messages import ModelInfo

PromptEncoding = DeepseekV4Encoding | DeepseekV41Encoding | ChatMLEncoding

# Without a tokenizer `--mock` counts prompts as 0 tokens; DeepSeek V4's context then only
# bounds max_tokens.
MOCK_CONTEXT_LIMIT = 1_048_576


@dataclass(frozen=True)
class ServedModel:
    """A model as the HTTP layer sees it; `encode` is None when prompts are not tokenized.

    `tool_call_grammar` turns the tools of a forced tool call into the grammar its output
    must match (DeepSeek's DSML block); None where calls are not constrained.
    """

    names: tuple[str, ...]
    conversion_options: ConversionOptions
    context_limit: int
    encoder: Callable[[Conversation], list[int]] | None = None
    tokenizer: Tokenizer | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    supports_tools: bool = True
    supports_thinking: bool = True
    tool_call_grammar: Callable[[Sequence[ToolDefinition]], str] | None = None
    # The encoding behind `encoder` (the playground shows its rendered prompts); None under
    # `--mock`, where each request's model version picks a DeepSeek encoding.
    encoding: PromptEncoding | None = None

    def encode(self, conversation: Conversation) -> list[int]:
        return self.encoder(conversation) if self.encoder is not None else []


def mock_model() -> ServedModel:
    """The `--mock` model: the recipe's default DeepSeek names, no weights, no tokenizer."""
    options = ConversionOptions()
    return ServedModel(
        names=tuple(sorted(options.model_versions_by_name)),
        conversion_options=options,
        context_limit=MOCK_CONTEXT_LIMIT,
    )


# DeepSeek architectures and the encoding / API model version each one speaks.
_DEEPSEEK = {
    "DeepseekV4ForCausalLM": (DeepseekV4Encoding, ModelVersion.DeepseekV4Pro),
    "DeepseekV41ForCausalLM": (DeepseekV41Encoding, ModelVersion.DeepseekV41Flash),
}


class UnsupportedModel(ValueError):
    """The workers serve a model whose prompt format deepwell cannot produce."""


def served_model(info: ModelInfo) -> ServedModel:
    """The HTTP-side view of the model the workers loaded, with the encoding its metadata names."""
    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    stop = list(info.eos_token_ids)
    if info.architecture in _DEEPSEEK:
        encoding_type, version = _DEEPSEEK[info.architecture]
        encoding = encoding_type().with_tokenizer(tokenizer)
        options = (
            ConversionOptions()
            .with_model_versions_by_name({info.name: version})
            .with_structured_output(True)
        )
        return ServedModel(
            names=(info.name,),
            conversion_options=options,
            context_limit=info.context_limit,
            encoder=encoding.encode,
            tokenizer=tokenizer,
            stop_token_ids=stop,
            tool_call_grammar=encoding.tool_call_grammar,
            encoding=encoding,
        )
    if info.chat_template is None:
        raise UnsupportedModel(f"model {info.name} has no chat template")
    try:
        encoding = ChatMLEncoding.from_chat_template(info.chat_template)
    except ValueError as error:
        raise UnsupportedModel(f"model {info.name}: {error}") from None
    encoding = encoding.with_tokenizer(tokenizer)
    for spelling in encoding.stop_tokens:
        token_id = tokenizer.special_token_id(spelling)
        if token_id is not None and token_id not in stop:
            stop.append(token_id)
    # ChatML models do not think; the API model version only steers request conversion,
    # and V4-Pro's keeps a requested top_p outside thinking (V4.1's forces 1.0, spec §6.1).
    options = (
        ConversionOptions()
        .with_model_versions_by_name({info.name: ModelVersion.DeepseekV4Pro})
        .with_default_thinking_mode(False)
        .with_structured_output(True)
    )
    return ServedModel(
        names=(info.name,),
        conversion_options=options,
        context_limit=info.context_limit,
        encoder=encoding.encode,
        tokenizer=tokenizer,
        stop_token_ids=stop,
        supports_tools=False,
        encoding=encoding,
        supports_thinking=False,
    )
