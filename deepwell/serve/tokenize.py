"""vLLM's `/tokenize` and `/detokenize`: a prompt (or chat messages) to ids, and ids to text.

Shapes follow vLLM's TokenizeRequest / TokenizeResponse / DetokenizeRequest; the messages
form renders through the served model's own chat encoding, with the request's
`chat_template_kwargs`, as a chat request would.
"""

from __future__ import annotations

from typing import Any

from deepwell.recipe import ChatCompletionRequest
from deepwell.serve.errors import ApiError
from deepwell.serve.frontend import Frontend, read_request, template_kwargs
from deepwell.serve.json_body import json_object
from deepwell.serve.model import ServedModel

# The chat request's fields that shape its prompt; `thinking` and `reasoning_effort` pick a
# DeepSeek model's thinking or non-thinking rendering.
CHAT_FIELDS = ("messages", "tools", "tool_choice", "thinking", "reasoning_effort")


def tokenize(frontend: Frontend, body: bytes) -> dict[str, Any]:
    """`{"prompt": str}` or `{"messages": [...], "tools": [...]}` → vLLM's TokenizeResponse;
    a message's images are read and each placeholder expanded into its span, as a chat
    request's prompt is (so the ids are what the model would read)."""
    model = frontend.model
    data = json_object(body)
    tokenizer = _tokenizer(model)
    name = _model_name(model, data)
    if "messages" in data:
        if data.get("add_generation_prompt", True) is not True or data.get(
            "continue_final_message"
        ):
            raise ApiError(
                400,
                "Unsupported parameter 'add_generation_prompt': the chat encoding always ends "
                "with the assistant's turn opening.",
                param="add_generation_prompt",
            )
        chat = {key: data[key] for key in CHAT_FIELDS if key in data}
        converted = read_request(ChatCompletionRequest, {**chat, "model": name}).convert(
            model.conversion_options
        )
        ids, _ = frontend.encode(name, converted.conversation, template_kwargs(body, model))
    else:
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "Invalid 'prompt': must be a string.", param="prompt")
        ids = tokenizer.encode(prompt)
    strs = [tokenizer.decode([i]) for i in ids] if data.get("return_token_strs") else None
    return {
        "count": len(ids),
        "max_model_len": model.context_limit,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(model: ServedModel, body: bytes) -> dict[str, Any]:
    """`{"tokens": [ids]}` → `{"prompt": text}`."""
    data = json_object(body)
    tokenizer = _tokenizer(model)
    _model_name(model, data)
    ids = data.get("tokens")
    vocab = tokenizer.vocab_size
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids
    ):
        raise ApiError(
            400, f"Invalid 'tokens': must be a list of token ids in [0, {vocab}).", param="tokens"
        )
    return {"prompt": tokenizer.decode(ids)}


def _tokenizer(model: ServedModel):
    if model.tokenizer is None:
        raise ApiError(400, "this server has no tokenizer (it serves --mock)")
    return model.tokenizer


def _model_name(model: ServedModel, data: dict[str, Any]) -> str:
    """The request's `model` (optional, as in vLLM); an unknown one is a 404."""
    name = data.get("model")
    if name is None:
        return model.names[0]
    if name not in model.names:
        raise ApiError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )
    return name
