"""ChatML prompts (`<|im_start|>role\\n…<|im_end|>\\n`) for non-DeepSeek models such as SmolLM2.

Same shape as the DeepSeek encodings: render with special ranges, encode, stop tokens.
"""

from __future__ import annotations

import copy
import re

from deepwell.recipe.conversation import AssistantMessage, Conversation
from deepwell.recipe.encoding.deepseek import encode_rendered
from deepwell.recipe.encoding.prompt import PromptBuilder, RenderedPrompt
from deepwell.recipe.encoding.tokenizer import Tokenizer

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# A template that injects a system turn when the conversation has none spells it like this.
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", re.DOTALL)


class ChatMLEncoding:
    """Role and content per turn, as ChatML chat templates render them.

    Like those templates, it renders what a message says, not how it was produced:
    reasoning, tool definitions and tool calls are not part of the prompt.
    """

    def __init__(self, default_system: str | None = None) -> None:
        self.default_system = default_system
        self._tokenizer: Tokenizer | None = None

    @classmethod
    def from_chat_template(cls, template: str) -> ChatMLEncoding:
        """The encoding a ChatML Jinja template describes (e.g. GGUF `tokenizer.chat_template`)."""
        if IM_START not in template or IM_END not in template:
            raise ValueError("not a ChatML chat template: <|im_start|> / <|im_end|> missing")
        match = _DEFAULT_SYSTEM.search(template)
        return cls(match.group(1).replace("\\n", "\n") if match else None)

    def with_tokenizer(self, tokenizer: Tokenizer) -> ChatMLEncoding:
        clone = copy.copy(self)
        clone._tokenizer = tokenizer
        return clone

    @property
    def stop_tokens(self) -> list[str]:
        """Spellings that end generation."""
        return [IM_END]

    def render_conversation(self, conversation: Conversation) -> RenderedPrompt:
        return self._render(conversation).build()

    def encode(self, conversation: Conversation) -> list[int]:
        if self._tokenizer is None:
            raise RuntimeError("no tokenizer is attached to the encoding")
        return encode_rendered(self._tokenizer, self._render(conversation))

    def _render(self, conversation: Conversation) -> PromptBuilder:
        out = PromptBuilder()
        messages = conversation.messages
        if messages and messages[0].role != "system" and self.default_system is not None:
            self._turn(out, "system", self.default_system)
        for index, message in enumerate(messages):
            last = index == len(messages) - 1
            if last and isinstance(message, AssistantMessage) and message.prefix:
                # The model continues this turn: no end marker, no new turn.
                out.special(IM_START)
                out.text(f"assistant\n{message.content}")
                return out
            self._turn(out, message.role, message.content)
        out.special(IM_START)
        out.text("assistant\n")
        return out

    @staticmethod
    def _turn(out: PromptBuilder, role: str, content: str) -> None:
        out.special(IM_START)
        out.text(f"{role}\n{content}")
        out.special(IM_END)
        out.text("\n")
