"""What DeepSeek V4 and V4.1 share: the encoding object, tool schemas, DSML call blocks, encode.

Each version renders its own message layout (v4.py, v41.py); spec/recipe.md §4, §5.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TypeVar

from deepwell.recipe.conversation import Conversation, ImageSource, ToolCall, ToolDefinition
from deepwell.recipe.encoding.prompt import PromptBuilder, RenderedPrompt, spelling_pattern
from deepwell.recipe.encoding.special_tokens import (
    DEFAULT_SPECIAL_TOKENS,
    GROUNDING_TOKENS,
    SpecialToken,
    SpecialTokens,
)
from deepwell.recipe.encoding.template_json import parse_arguments
from deepwell.recipe.encoding.templates import RESPONSE_FORMAT_HEADER, emit_tool_prompt
from deepwell.recipe.encoding.tokenizer import Tokenizer
from deepwell.recipe.encoding.tool_call_grammar import DsmlTags, tool_call_grammar
from deepwell.recipe.json_value import JsonValue, py_json

EncodingT = TypeVar("EncodingT", bound="DeepseekEncoding")


class DeepseekEncoding(ABC):
    """Renders a Conversation into a DeepSeek prompt and, with a tokenizer, into token ids."""

    # (calls, invoke, parameter) tag names after the DSML token.
    tag_names: tuple[str, str, str]

    def __init__(self) -> None:
        self._tokenizer: Tokenizer | None = None
        self._set_special_tokens(DEFAULT_SPECIAL_TOKENS)

    def _set_special_tokens(self, special_tokens: SpecialTokens) -> None:
        token = special_tokens.token
        self._bos = token(SpecialToken.Bos)
        self._eos = token(SpecialToken.Eos)
        self._think = token(SpecialToken.ThinkingStart)
        self._end_think = token(SpecialToken.ThinkingEnd)
        self._system = token(SpecialToken.System)
        self._user = token(SpecialToken.User)
        self._assistant = token(SpecialToken.Assistant)
        self._reminder = token(SpecialToken.LatestReminder)
        self._dsml = token(SpecialToken.Dsml)
        # spec/recipe.md §15.5: grounding spellings are control tokens in assistant text.
        self._grounding = spelling_pattern([token(t) for t in GROUNDING_TOKENS])

    def with_tokenizer(self: EncodingT, tokenizer: Tokenizer) -> EncodingT:
        clone = copy.copy(self)
        clone._tokenizer = tokenizer
        return clone

    def with_special_tokens(self: EncodingT, special_tokens: SpecialTokens) -> EncodingT:
        clone = copy.copy(self)
        clone._set_special_tokens(special_tokens)
        return clone

    @property
    def stop_tokens(self) -> list[str]:
        """Spellings that end generation."""
        return [self._eos]

    def render_conversation(self, conversation: Conversation) -> RenderedPrompt:
        out, images = self._render(conversation)
        return out.build(images)

    def encode(self, conversation: Conversation) -> list[int]:
        return self.encode_with_images(conversation)[0]

    def encode_with_images(self, conversation: Conversation) -> tuple[list[int], list[ImageSource]]:
        """The prompt ids and, in prompt order, the images its placeholders stand for (a
        rendering may drop a message's images: they are not in the list then)."""
        if self._tokenizer is None:
            raise RuntimeError("no tokenizer is attached to the encoding")
        out, images = self._render(conversation)
        return encode_rendered(self._tokenizer, out), images

    def tool_call_grammar(self, tools: Sequence[ToolDefinition]) -> str:
        """The Lark grammar a forced tool call (tool_choice required) must match.

        It continues the generation suffix's opening calls tag and ends with the closing
        one; `｜DSML｜` is matched by its id in the attached tokenizer.
        """
        if self._tokenizer is None:
            raise RuntimeError("no tokenizer is attached to the encoding")
        dsml_token_id = self._tokenizer.special_token_id(self._dsml)
        if dsml_token_id is None:
            raise RuntimeError(f'special token "{self._dsml}" is not in the added vocabulary')
        calls, invoke, parameter = self.tag_names
        tags = DsmlTags(calls, invoke, parameter, self._empty_invoke_body(), dsml_token_id)
        return tool_call_grammar(tools, tags)

    @abstractmethod
    def _render(self, conversation: Conversation) -> tuple[PromptBuilder, list[ImageSource]]:
        """The prompt pieces and the image sources they refer to, in order."""

    # --- pieces both versions render the same way ---

    def _json(self, value: JsonValue) -> str:
        """A schema or a non-string argument value as the template writes it."""
        return py_json(value)

    def _schemas(self, tools: Sequence[ToolDefinition], *, with_deferred: bool) -> list[str]:
        return [
            self._json(
                {
                    "name": tool.name,
                    "description": tool.description or "",
                    "parameters": tool.parameters,
                }
            )
            for tool in tools
            if with_deferred or not tool.defer_loading
        ]

    @abstractmethod
    def _schema_block(self, tools: Sequence[ToolDefinition]) -> str:
        """The schema lines of the tool prompt, each announced tool once, ending in a newline."""

    def _emit_system_suffixes(self, out: PromptBuilder, conversation: Conversation) -> None:
        """Tool prompt (when tools are active) and response-format text, after system text."""
        if has_tools(conversation):
            out.text("\n\n")
            emit_tool_prompt(
                out,
                self._schema_block(conversation.tools),
                dsml=self._dsml,
                think=self._think,
                end_think=self._end_think,
                tag_names=self.tag_names,
            )
        if conversation.response_format == "json_object":
            out.text(self._json_object_suffix())
        elif conversation.response_format == "json_schema":
            out.text(RESPONSE_FORMAT_HEADER + self._json(conversation.response_schema))

    @abstractmethod
    def _json_object_suffix(self) -> str:
        """The response-format text for `json_object`."""

    def _emit_assistant_text(self, out: PromptBuilder, text: str) -> None:
        out.text_with_tokens(text, self._grounding)

    def _emit_tool_calls(self, out: PromptBuilder, calls: Sequence[ToolCall]) -> None:
        """The DSML block: `\\n\\n<DSML calls>\\n`, each invoke and a newline, `</DSML calls>`."""
        calls_tag, invoke_tag, parameter_tag = self.tag_names
        out.text("\n\n<")
        out.special(self._dsml)
        out.text(f"{calls_tag}>\n")
        for call in calls:
            out.text("<")
            out.special(self._dsml)
            out.text(f'{invoke_tag} name="{call.name}">\n')
            parameters = self._call_parameters(call.arguments)
            for key, is_string, value in parameters:
                out.text("<")
                out.special(self._dsml)
                flag = "true" if is_string else "false"
                out.text(f'{parameter_tag} name="{key}" string="{flag}">{value}</')
                out.special(self._dsml)
                out.text(f"{parameter_tag}>\n")
            if not parameters:
                out.text(self._empty_invoke_body())
            out.text("</")
            out.special(self._dsml)
            out.text(f"{invoke_tag}>\n")
        out.text("</")
        out.special(self._dsml)
        out.text(f"{calls_tag}>")

    @abstractmethod
    def _empty_invoke_body(self) -> str:
        """What stands between the invoke tags of a call without parameters."""

    def _call_parameters(self, arguments: str) -> list[tuple[str, bool, str]]:
        # spec/recipe.md §4.3: a JSON object gives one parameter per key; anything else is a
        # single raw `arguments` string.
        parsed = parse_arguments(arguments)
        if parsed is None:
            return [("arguments", True, arguments)]
        return [
            (key, True, value) if isinstance(value, str) else (key, False, self._json(value))
            for key, value in parsed.items()
        ]

    def _emit_generation_suffix(
        self, out: PromptBuilder, conversation: Conversation, *, after_prefix: bool
    ) -> None:
        """A new assistant turn, unless the prompt ends inside a prefix assistant."""
        if not after_prefix:
            out.special(self._assistant)
            out.special(self._think if conversation.thinking_mode else self._end_think)
        if conversation.tool_choice == "required" and conversation.tools:
            out.text("\n\n<")
            out.special(self._dsml)
            out.text(f"{self.tag_names[0]}>\n")


def has_tools(conversation: Conversation) -> bool:
    return conversation.tool_choice != "none" and bool(conversation.tools)


def needs_system_head(conversation: Conversation) -> bool:
    """Tools or a JSON format put text into a leading system message (spec/recipe.md §4.2)."""
    return has_tools(conversation) or conversation.response_format in ("json_object", "json_schema")


def encode_rendered(tokenizer: Tokenizer, out: PromptBuilder) -> list[int]:
    """Special pieces → fixed ids by spelling; plain runs → one plain-tokenizer batch."""
    runs, units = out.plain_runs()
    special_ids: dict[str, int] = {}
    for unit in units:
        if unit is not None and unit not in special_ids:
            token_id = tokenizer.special_token_id(unit)
            if token_id is None:
                raise RuntimeError(
                    f'failed to encode conversation: special token "{unit}" '
                    "is not in the added vocabulary"
                )
            special_ids[unit] = token_id
    encoded = iter(tokenizer.encode_plain(runs))
    ids: list[int] = []
    for unit in units:
        if unit is None:
            ids.extend(next(encoded))
        else:
            ids.append(special_ids[unit])
    return ids
