"""What the HTTP process knows about the served model: names, encoding, tokenizer, context.

The model's metadata picks the encoding: DeepSeek V4 / V4.1 for DeepSeek models, the model's
own Jinja chat template (or `--chat-template`) for every other one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from deepwell.recipe import (
    Conversation,
    ConversionOptions,
    DeepseekV4Encoding,
    DeepseekV41Encoding,
    ModelVersion,
    Tokenizer,
    ToolDefinition,
)
from deepwell.recipe.encoding.chat_template import ChatTemplateEncoding, ChatTemplateError
from deepwell.recipe.encoding.json_call_grammar import json_call_grammar
from deepwell.recipe.json_value import JsonValue
from deepwell.recipe.stream.json_calls import DSML
from deepwell.serve.images.grid import VisionSpec
from deepwell.serve.messages import ModelInfo

PromptEncoding = DeepseekV4Encoding | DeepseekV41Encoding | ChatTemplateEncoding

# Without a tokenizer `--mock` counts prompts as 0 tokens; DeepSeek V4's context then only
# bounds max_tokens.
MOCK_CONTEXT_LIMIT = 1_048_576
# The released DeepSeek-V4.1-Flash vision config: `--mock` checks and preprocesses images as
# that model would, then gives its fixed reply.
RELEASED_V41_VISION = VisionSpec(image_token_id=129264)


@dataclass(frozen=True)
class ServedModel:
    """A model as the HTTP layer sees it; `encode` is None when prompts are not tokenized.

    `tool_call_grammar` turns the tools of a forced tool call into the grammar its output
    must match (DeepSeek's DSML block, a Hermes or Llama-3 JSON call); None where calls are
    not constrained. `tool_call_format` tells the stream parser how calls are written.
    """

    names: tuple[str, ...]
    conversion_options: ConversionOptions
    context_limit: int
    encoder: Callable[..., list[int]] | None = None
    tokenizer: Tokenizer | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    supports_tools: bool = True
    supports_thinking: bool = True
    tool_call_grammar: Callable[[Sequence[ToolDefinition]], str] | None = None
    tool_call_format: str = DSML
    # Chat-template encoders take a request's `chat_template_kwargs`; DeepSeek's do not.
    takes_template_kwargs: bool = False
    # The encoding behind `encoder` (the playground shows its rendered prompts); None under
    # `--mock`, where each request's model version picks a DeepSeek encoding.
    encoding: PromptEncoding | None = None
    # How the model's vision tower takes images; None: the model sees none, and a request
    # with an image is refused naming it (V4-Pro's stand-in text aside, images.py).
    vision: VisionSpec | None = None

    def encode(
        self, conversation: Conversation, template_kwargs: Mapping[str, JsonValue] | None = None
    ) -> list[int]:
        if self.encoder is None:
            return []
        if template_kwargs:
            return self.encoder(conversation, template_kwargs)
        return self.encoder(conversation)


def mock_model() -> ServedModel:
    """The `--mock` model: the recipe's default DeepSeek names, no weights, no tokenizer."""
    options = ConversionOptions().with_local_image_files(True)
    return ServedModel(
        names=tuple(sorted(options.model_versions_by_name)),
        conversion_options=options,
        context_limit=MOCK_CONTEXT_LIMIT,
        vision=RELEASED_V41_VISION,
    )


def deepseek_encoding(
    architecture: str,
) -> tuple[type[DeepseekV4Encoding | DeepseekV41Encoding], ModelVersion] | None:
    """The DeepSeek encoding and API model version an architecture speaks, from the
    engine's architecture table; None for a model prompted through its chat template."""
    # Imported here: `serve --mock` and the command line load no engine module
    # (tests/settings/test_flags.py); the table itself is torch-free.
    from deepwell.engine.models.architectures import (
        DEEPSEEK_V4_ENCODING,
        DEEPSEEK_V41_ENCODING,
        architecture_named,
    )

    entry = architecture_named(architecture)
    if entry.prompt_encoding is None:
        return None
    encodings = {
        DEEPSEEK_V4_ENCODING: DeepseekV4Encoding,
        DEEPSEEK_V41_ENCODING: DeepseekV41Encoding,
    }
    return encodings[entry.prompt_encoding], ModelVersion(entry.model_version)


class UnsupportedModel(ValueError):
    """The workers serve a model whose prompt format deepwell cannot produce."""


def served_model(
    info: ModelInfo, chat_template: str | None = None, tool_call_parser: str | None = None
) -> ServedModel:
    """The HTTP-side view of the model the workers loaded, with the encoding its metadata names.

    `chat_template` (`--chat-template`) replaces the model's own; `tool_call_parser`
    (`--tool-call-parser`) says how a template model writes tool calls, None: it has no tools.
    """
    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    stop = list(info.eos_token_ids)
    deepseek = deepseek_encoding(info.architecture)
    if deepseek is not None and chat_template is None:
        if tool_call_parser is not None:
            raise UnsupportedModel("DeepSeek models write DSML tool calls; drop --tool-call-parser")
        return _deepseek_model(info, tokenizer, *deepseek)
    template = chat_template if chat_template is not None else info.chat_template
    if template is None:
        raise UnsupportedModel(
            f"model {info.name} has no chat template; give one with --chat-template FILE"
        )
    try:
        encoding = ChatTemplateEncoding(
            template,
            bos_token=_spelling(tokenizer, info.bos_token_id),
            eos_token=_spelling(tokenizer, info.eos_token_ids[0] if info.eos_token_ids else None),
        ).with_tokenizer(tokenizer)
    except ChatTemplateError as error:
        raise UnsupportedModel(f"model {info.name}: {error}") from None
    for spelling in encoding.stop_tokens:
        token_id = tokenizer.special_token_id(spelling)
        if token_id is not None and token_id not in stop:
            stop.append(token_id)
    grammar = None
    if tool_call_parser is not None:
        grammar = functools.partial(
            json_call_grammar,
            tool_call_format=tool_call_parser,
            token_id=tokenizer.special_token_id,
        )
    # Template models do not think here; the API model version only steers request
    # conversion, and V4-Pro's keeps a requested top_p outside thinking (V4.1's forces 1.0,
    # spec §6.1).
    options = (
        ConversionOptions()
        .with_model_versions_by_name({info.name: ModelVersion.DeepseekV4Pro})
        .with_default_thinking_mode(False)
        .with_structured_output(True)
        # A template model sees no image: keep each as a source, so the refusal names it
        # (V4-Pro's "[Unsupported Image]" stand-in is DeepSeek's behaviour, not theirs).
        .with_images_supported(True)
        .with_local_image_files(True)
    )
    return ServedModel(
        names=(info.name,),
        conversion_options=options,
        context_limit=info.context_limit,
        encoder=encoding.encode,
        tokenizer=tokenizer,
        stop_token_ids=stop,
        supports_tools=tool_call_parser is not None,
        encoding=encoding,
        supports_thinking=False,
        tool_call_grammar=grammar,
        tool_call_format=tool_call_parser or DSML,
        takes_template_kwargs=True,
    )


def _deepseek_model(
    info: ModelInfo,
    tokenizer: Tokenizer,
    encoding_type: type[DeepseekV4Encoding | DeepseekV41Encoding],
    version: ModelVersion,
) -> ServedModel:
    """A DeepSeek model, prompted through the recipe's encoding of its version."""
    encoding = encoding_type().with_tokenizer(tokenizer)
    options = (
        ConversionOptions()
        .with_model_versions_by_name({info.name: version})
        .with_structured_output(True)
        # file:// URLs reach the server, which reads them only where it is allowed to.
        .with_local_image_files(True)
    )
    return ServedModel(
        names=(info.name,),
        conversion_options=options,
        context_limit=info.context_limit,
        encoder=encoding.encode,
        tokenizer=tokenizer,
        stop_token_ids=list(info.eos_token_ids),
        tool_call_grammar=encoding.tool_call_grammar,
        encoding=encoding,
        vision=info.vision,
    )


def renamed(model: ServedModel, names: Sequence[str]) -> ServedModel:
    """The model served under `names` (serve --served-model-name), each converting requests
    as its first name did."""
    options = model.conversion_options
    version = options.model_versions_by_name[model.names[0]]
    return replace(
        model,
        names=tuple(names),
        conversion_options=options.with_model_versions_by_name(dict.fromkeys(names, version)),
    )


def _spelling(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.decode([token_id])
