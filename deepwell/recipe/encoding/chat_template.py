"""A model's own Jinja chat template, rendered in a sandbox the way transformers renders it.

For every non-DeepSeek model: the template's text becomes a prompt with special ranges.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deepwell.recipe.conversation import AssistantMessage, Conversation, Message
from deepwell.recipe.encoding.deepseek import encode_rendered
from deepwell.recipe.encoding.prompt import PromptBuilder, RenderedPrompt, spelling_pattern
from deepwell.recipe.encoding.template_json import parse_arguments
from deepwell.recipe.encoding.tokenizer import Tokenizer
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.json_value import JsonValue

# Turn ends of common chat formats (ChatML, Llama 3, Phi, Gemma): a template that writes one
# ends assistant turns with it, though checkpoints often name another token as EOS.
END_OF_TURN_SPELLINGS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# Names the renderer passes itself; a request's chat_template_kwargs may not replace them.
RESERVED_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


class ChatTemplateError(ValueError):
    """A chat template that does not compile (raised when the encoding is built)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`: transformers marks assistant text with it for
    training masks; rendering a prompt keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: jinja2's own escapes HTML characters and sorts keys.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, but an unsafe attribute is refused at once: jinja2 yields an
    undefined that renders as "" unless used further, which would let a probe pass unseen."""

    def unsafe_undefined(self, obj: object, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe."
        )


def compile_template(source: str) -> jinja2.Template:
    """The template in transformers' sandboxed environment: same options, filters, globals."""
    environment = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template line {error.lineno}: {error.message}") from None


class ChatTemplateEncoding:
    """Renders a Conversation through a model's chat template; encodes it with the model's
    tokenizer. Added-token spellings the template writes are special; the same spellings
    inside message text stay plain text (a user cannot type a control token)."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = compile_template(source)
        self._tokenizer: Tokenizer | None = None
        self._specials: re.Pattern[str] | None = None

    def with_tokenizer(self, tokenizer: Tokenizer) -> ChatTemplateEncoding:
        clone = copy.copy(self)
        clone._tokenizer = tokenizer
        clone._specials = spelling_pattern(tokenizer.added_spellings())
        return clone

    @property
    def stop_tokens(self) -> list[str]:
        """Spellings that end generation: EOS and the turn ends the template writes."""
        ends = [s for s in END_OF_TURN_SPELLINGS if s in self.source and s != self.eos_token]
        return ([self.eos_token] if self.eos_token else []) + ends

    def render_conversation(
        self, conversation: Conversation, template_kwargs: Mapping[str, JsonValue] | None = None
    ) -> RenderedPrompt:
        return self._render(conversation, template_kwargs).build()

    def encode(
        self, conversation: Conversation, template_kwargs: Mapping[str, JsonValue] | None = None
    ) -> list[int]:
        if self._tokenizer is None:
            raise RuntimeError("no tokenizer is attached to the encoding")
        return encode_rendered(self._tokenizer, self._render(conversation, template_kwargs))

    def _render(
        self, conversation: Conversation, template_kwargs: Mapping[str, JsonValue] | None
    ) -> PromptBuilder:
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & set(RESERVED_VARIABLES))
        if reserved:
            raise ConversionError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        messages = conversation.messages
        for message in messages:
            if message.image_sources:
                raise ConversionError("The model's chat template does not take images.")
        guard = _TextGuard(self.source, messages, self._specials)
        prefix = messages[-1] if messages and _is_prefix(messages[-1]) else None
        variables = {
            **kwargs,
            "messages": [guard.message(m, m is prefix) for m in messages],
            "add_generation_prompt": prefix is None,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        if conversation.tools and conversation.tool_choice != "none":
            variables["tools"] = [_tool(t) for t in conversation.tools]
        try:
            text = self._template.render(variables)
        except SecurityError as error:
            raise ConversionError(f"chat template refused: {error}") from None
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, LookupError) as error:
            # Templates index, add and compare request data; a failure is the request's.
            raise ConversionError(f"chat template error: {error}") from None
        out = PromptBuilder()
        if prefix is not None:
            # The model continues the last assistant turn: cut after its content, as
            # transformers' continue_final_message does.
            at = text.rfind(guard.prefix_marker)
            if at < 0:
                raise ConversionError("the chat template does not render the assistant prefix")
            guard.emit(out, text[:at])
            out.text(prefix.content)
            return out
        guard.emit(out, text)
        return out


def _is_prefix(message: Message) -> bool:
    return isinstance(message, AssistantMessage) and message.prefix


def _tool(tool) -> dict:
    function: dict = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


class _TextGuard:
    """Hides control-token spellings inside message text from the renderer.

    Each such spelling is replaced by `D index D` with a private-use character D that occurs
    in neither the template nor the messages; after rendering, these go back as plain text
    while the spellings the template itself wrote become special tokens.
    """

    def __init__(
        self, source: str, messages: list[Message], specials: re.Pattern[str] | None
    ) -> None:
        seen = source + "".join(_texts(messages))
        self.delimiter = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in seen)
        # Stands for the content of an assistant prefix: the prompt is cut where it lands.
        self.prefix_marker = self.delimiter * 2
        self._specials = specials
        self._hidden: list[str] = []

    def hide(self, text: str) -> str:
        if self._specials is None:
            return text
        d = self.delimiter

        def replace(match: re.Match[str]) -> str:
            self._hidden.append(match.group())
            return f"{d}{len(self._hidden) - 1}{d}"

        return self._specials.sub(replace, text)

    def message(self, message: Message, is_prefix: bool) -> dict:
        """A message as transformers' templates read it (OpenAI chat shape)."""
        content = self.prefix_marker if is_prefix else self.hide(message.content)
        entry: dict = {"role": message.role, "content": content}
        if message.reasoning_content is not None:
            entry["reasoning_content"] = self.hide(message.reasoning_content)
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    # Templates write arguments with `| tojson`: an object, as vLLM passes
                    # them; text that is no JSON object stays text.
                    "function": {"name": call.name, "arguments": _arguments(call.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        return entry

    def emit(self, out: PromptBuilder, text: str) -> None:
        d = re.escape(self.delimiter)
        parts = [f"{d}(\\d+){d}"] + ([self._specials.pattern] if self._specials else [])
        at = 0
        for match in re.finditer("|".join(f"(?:{p})" for p in parts), text):
            out.text(text[at : match.start()])
            if match.group(1) is not None:
                out.text(self._hidden[int(match.group(1))])
            else:
                out.special(match.group())
            at = match.end()
        out.text(text[at:])


def _texts(messages: list[Message]) -> list[str]:
    texts = []
    for message in messages:
        texts.append(message.content)
        texts.append(message.reasoning_content or "")
        for call in message.tool_calls or []:
            texts += [call.name, call.arguments]
    return texts


def _arguments(arguments: str) -> JsonValue:
    parsed = parse_arguments(arguments)
    return arguments if parsed is None else parsed
