"""DeepSeek V4 prompt layout: one hoisted system text, merged users, tool calls ordered by id.

Behaviour of the reference V4 renderer, spec/recipe.md §4 and §15.3–15.5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from deepwell.recipe.conversation import (
    AssistantMessage,
    Conversation,
    ImageSource,
    Message,
    ToolDefinition,
)
from deepwell.recipe.encoding.deepseek import DeepseekEncoding, has_tools, needs_system_head
from deepwell.recipe.encoding.prompt import PromptBuilder
from deepwell.recipe.encoding.templates import V4_JSON_OBJECT_SUFFIX, v4_effort_text


@dataclass
class _Turn:
    """One rendered turn: a message, or several merged ones (head system, user runs)."""

    role: str
    message: Message | None
    # Messages whose non-empty contents are joined with "\n\n".
    parts: list[Message] = field(default_factory=list)
    images: list[ImageSource] = field(default_factory=list)


def _tool_window_key(turn: _Turn) -> tuple[int, str]:
    # Results sort by call id as strings; a result without an id sorts first and any other
    # message last (measured on the reference; spec/recipe.md §4.2, §15.3).
    if turn.role != "tool":
        return (2, "")
    call_id = turn.message.tool_call_id if turn.message is not None else None
    return (0, "") if call_id is None else (1, call_id)


class DeepseekV4Encoding(DeepseekEncoding):
    """The DeepSeek-V4-Pro prompt format."""

    tag_names = ("tool_calls", "invoke", "parameter")

    def _json_object_suffix(self) -> str:
        return V4_JSON_OBJECT_SUFFIX

    def _empty_invoke_body(self) -> str:
        return ""

    def _schema_block(self, tools: Sequence[ToolDefinition]) -> str:
        # Each schema line ends in its own newline, so no schema leaves one newline (measured).
        return "".join(line + "\n" for line in self._schemas(tools, with_deferred=False))

    def _render(self, conversation: Conversation) -> tuple[PromptBuilder, list[ImageSource]]:
        turns = _normalize(conversation)
        tools_active = has_tools(conversation)
        thinking = conversation.thinking_mode
        out = PromptBuilder()
        out.special(self._bos)
        out.text(v4_effort_text(thinking, conversation.reasoning_effort))
        images: list[ImageSource] = []
        previous = None
        last = len(turns) - 1
        for index, turn in enumerate(turns):
            role = turn.role
            images.extend(turn.images)
            if role == "system":
                self._emit_parts(out, turn.parts)
                if index == 0:
                    self._emit_system_suffixes(out, conversation)
            elif role == "user":
                if previous in ("user", "tool"):
                    out.text("\n\n")
                else:
                    out.special(self._user)
                self._emit_parts(out, turn.parts)
            elif role == "tool":
                if previous == "tool":
                    out.text("\n\n")
                else:
                    out.special(self._user)
                out.text("<tool_result>")
                self._emit_parts(out, turn.parts)
                out.text("</tool_result>")
            elif role == "latest_reminder":
                out.special(self._reminder)
                out.text(turn.message.content)
            else:
                message = turn.message
                self._emit_assistant(out, message, tools_active, thinking, final=index == last)
            previous = role
        after_prefix = bool(turns) and turns[-1].role == "assistant" and turns[-1].message.prefix
        self._emit_generation_suffix(out, conversation, after_prefix=after_prefix)
        return out, images

    def _emit_parts(self, out: PromptBuilder, parts: list[Message]) -> None:
        for i, message in enumerate(parts):
            if i:
                out.text("\n\n")
            out.text_with_spans(message.content, message.image_spans)

    def _emit_assistant(
        self,
        out: PromptBuilder,
        message: AssistantMessage,
        tools_active: bool,
        thinking: bool,
        *,
        final: bool,
    ) -> None:
        # A prefix flag shapes the thinking part wherever the message stands; only a final
        # prefix goes without EOS (measured on the reference).
        out.special(self._assistant)
        content = message.content
        prefix = message.prefix
        open_reasoning = prefix and thinking and content == ""
        if (tools_active or prefix) and message.reasoning_content is not None:
            out.special(self._think)
            self._emit_assistant_text(out, message.reasoning_content)
            if not open_reasoning:
                out.special(self._end_think)
        elif not open_reasoning:
            out.special(self._end_think)
        self._emit_assistant_text(out, content)
        # An empty call list still opens and closes a block in V4 (measured).
        if message.tool_calls is not None:
            self._emit_tool_calls(out, sorted(message.tool_calls, key=lambda call: call.id))
        if not (prefix and final):
            out.special(self._eos)


def _normalize(conversation: Conversation) -> list[_Turn]:
    """Hoist systems into one head, merge user runs, order tool results (spec/recipe.md §4.2)."""
    messages = conversation.messages
    turns: list[_Turn] = []
    systems = [m for m in messages if m.role == "system"]
    if systems:
        head = _Turn("system", systems[0], [m for m in systems if m.content])
        # Empty system messages leave no trace, not even their images (measured).
        for m in head.parts:
            head.images.extend(m.image_sources)
        turns.append(head)
    for m in messages:
        role = m.role
        if role == "system":
            continue
        if role == "user" and turns and turns[-1].role == "user":
            merged = turns[-1]
        else:
            merged = _Turn(role, m)
            turns.append(merged)
        if m.content or role != "user":
            merged.parts.append(m)
        merged.images.extend(m.image_sources)
    # Each assistant with N calls sorts the N turns after its original position, in order,
    # even when an earlier sort moved other turns into that window.
    windows = [
        (i, len(t.message.tool_calls))
        for i, t in enumerate(turns)
        if t.role == "assistant" and t.message.tool_calls
    ]
    for start, size in windows:
        if start + 1 + size <= len(turns):
            turns[start + 1 : start + 1 + size] = sorted(
                turns[start + 1 : start + 1 + size], key=_tool_window_key
            )
    if needs_system_head(conversation) and (not turns or turns[0].role != "system"):
        turns.insert(0, _Turn("system", None))
    return turns
