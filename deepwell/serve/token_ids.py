"""vLLM's `return_token_ids` on Chat Completions: the prompt's ids (image spans expanded)
beside the choices, and the ids each choice generated, so a user sees what the model read.

A choice's `token_ids` are the tokens its text came from (as many as its usage's
`completion_tokens`); streamed, each chunk carries the ids that arrived since the last one,
and the first chunk carries `prompt_token_ids`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from deepwell.serve.errors import ApiError

FIELD = "return_token_ids"


def wants_token_ids(data: Mapping[str, Any]) -> bool:
    """The body's `return_token_ids`; ApiError 400 unless it is a boolean (or absent)."""
    value = data.get(FIELD)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"Invalid '{FIELD}': must be a boolean, got {value!r}.", param=FIELD)
    return value


class ChatTokenIds:
    """Adds the ids to one chat request's response, or to its chunks as they stream."""

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self._sent = 0
        self._prompt_sent = False

    def response(self, text: str, output_token_ids: Sequence[int]) -> str:
        """The `chat.completion` JSON with the prompt's ids and each choice's ids."""
        body = json.loads(text)
        body["prompt_token_ids"] = self.prompt_token_ids
        for choice in body.get("choices", []):
            choice["token_ids"] = list(output_token_ids)
        return json.dumps(body, ensure_ascii=False)

    def chunk(self, text: str, output_token_ids: Sequence[int]) -> str:
        """A `chat.completion.chunk` JSON: the prompt's ids on the first, and on each chunk
        with a choice the ids not yet sent (a chunk without one, usage, keeps them)."""
        body = json.loads(text)
        if not isinstance(body, dict) or body.get("object") != "chat.completion.chunk":
            return text
        if not self._prompt_sent:
            body["prompt_token_ids"] = self.prompt_token_ids
            self._prompt_sent = True
        choices = body.get("choices") or []
        for choice in choices:
            choice["token_ids"] = list(output_token_ids[self._sent :])
        if choices:
            self._sent = len(output_token_ids)
        return json.dumps(body, ensure_ascii=False)
