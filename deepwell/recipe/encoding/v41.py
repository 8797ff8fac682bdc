"""DeepSeek V4.1 prompt layout: systems in place with `<｜System｜>`, tool results in call order.

Behaviour of the reference V4.1 renderer, spec/recipe.md §4 and §15.3–15.5.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepwell.recipe.conversation import (
    AssistantMessage,
    Conversation,
    ImageSource,
    Message,
    SystemMessage,
    ToolDefinition,
)
from deepwell.recipe.encoding.deepseek import DeepseekEncoding, has_tools, needs_system_head
from deepwell.recipe.encoding.prompt import PromptBuilder
from deepwell.recipe.encoding.template_json import python_json
from deepwell.recipe.encoding.templates import (
    UPDATED_TOOL_SCHEMAS_HEADER,
    V41_JSON_OBJECT_SUFFIX,
    v41_effort_text,
)
from deepwell.recipe.json_value import JsonValue


class DeepseekV41Encoding(DeepseekEncoding):
    """The DeepSeek-V4.1-Flash prompt format."""

    tag_names = (" calls", " invoke", " parameter")

    def _json(self, value: JsonValue) -> str:
        # V4.1's template writes floats as Python does (`1e-05`), unlike V4 (spec §15.4).
        return python_json(value)

    def _json_object_suffix(self) -> str:
        return V41_JSON_OBJECT_SUFFIX

    def _empty_invoke_body(self) -> str:
        return "\n"

    def _schema_block(self, tools: Sequence[ToolDefinition]) -> str:
        return "\n".join(self._schemas(tools, with_deferred=False)) + "\n"

    def _render(self, conversation: Conversation) -> tuple[PromptBuilder, list[ImageSource]]:
        messages = _normalize(conversation)
        tools_active = has_tools(conversation)
        thinking = conversation.thinking_mode
        effort = v41_effort_text(thinking, conversation.reasoning_effort)
        out = PromptBuilder()
        out.special(self._bos)
        images: list[ImageSource] = []
        previous = None
        for index, message in enumerate(messages):
            role = message.role
            images.extend(message.image_sources)
            if index == 0 and effort:
                # spec/recipe.md §4.3: the effort text opens the first system message, or a
                # system turn of its own before a non-system first message.
                out.special(self._system)
                out.text(effort)
            elif role == "system":
                out.special(self._system)
            if role == "system":
                out.text_with_spans(message.content, message.image_spans)
                if index == 0:
                    self._emit_system_suffixes(out, conversation)
                if message.tools:
                    out.text(UPDATED_TOOL_SCHEMAS_HEADER)
                    out.text("\n".join(self._schemas(message.tools, with_deferred=True)))
            elif role in ("user", "tool"):
                if previous in ("user", "tool"):
                    out.text("\n\n")
                else:
                    out.special(self._user)
                if role == "tool":
                    out.text("<tool_result>")
                out.text_with_spans(message.content, message.image_spans)
                if role == "tool":
                    out.text("</tool_result>")
            elif role == "latest_reminder":
                out.special(self._reminder)
                out.text(message.content)
            else:
                # A prefix assistant never ends with EOS, last or not (measured).
                keep = thinking and (tools_active or message.prefix) and index > 0
                self._emit_assistant(out, message, message.prefix, keep)
            previous = role
        after_prefix = bool(messages) and messages[-1].role == "assistant" and messages[-1].prefix
        self._emit_generation_suffix(out, conversation, after_prefix=after_prefix)
        return out, images

    def _emit_assistant(
        self, out: PromptBuilder, message: AssistantMessage, prefix: bool, keep_reasoning: bool
    ) -> None:
        out.special(self._assistant)
        content = message.content
        if keep_reasoning:
            out.special(self._think)
            self._emit_assistant_text(out, message.reasoning_content or "")
            # A prefix with nothing after the reasoning leaves it open for the model.
            if not (prefix and content == "" and not message.tool_calls):
                out.special(self._end_think)
        else:
            out.special(self._end_think)
        self._emit_assistant_text(out, content)
        if message.tool_calls:
            self._emit_tool_calls(out, message.tool_calls)
        if not prefix:
            out.special(self._eos)


def _normalize(conversation: Conversation) -> list[Message]:
    """Drop repeated reminders, order tool results, add the system head (spec/recipe.md §4.2)."""
    messages: list[Message] = []
    for m in conversation.messages:
        if m.role == "latest_reminder" and messages and messages[-1].role == "latest_reminder":
            continue
        messages.append(m)
    # Every run of user/tool turns sorts its results into the call order of the latest
    # assistant that made calls, even when a system turn, a reminder or an assistant
    # without calls stands between them (measured on the reference).
    order: dict[str, int] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.role not in ("user", "tool"):
            if m.role == "assistant" and m.tool_calls:
                order = {}
                for position, call in enumerate(m.tool_calls):
                    order.setdefault(call.id, position)
            i += 1
            continue
        end = i
        while end < len(messages) and messages[end].role in ("user", "tool"):
            end += 1
        # Results with an id move; unknown ids count as the first call. Users and results
        # without an id keep their slots.
        slots = [j for j in range(i, end) if messages[j].tool_call_id is not None]
        results = sorted((messages[j] for j in slots), key=lambda r: order.get(r.tool_call_id, 0))
        for j, result in zip(slots, results, strict=True):
            messages[j] = result
        i = end
    if needs_system_head(conversation) and (not messages or messages[0].role != "system"):
        messages.insert(0, SystemMessage(""))
    return messages
