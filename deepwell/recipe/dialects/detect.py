"""Which of the three dialects a request body is written in, guessed from its shape.

For tools that take a request without its route (`deepwell render`, the playground).
"""

from __future__ import annotations

DIALECTS = ("chat", "responses", "messages")
# Top-level fields and content blocks only Anthropic Messages requests have.
_MESSAGES_ONLY_FIELDS = ("system", "stop_sequences", "top_k", "anthropic_version")
_MESSAGES_ONLY_BLOCKS = ("tool_use", "tool_result", "thinking", "redacted_thinking")


def detect_dialect(body: object) -> str:
    """`input` → responses; a top-level `system`/`stop_sequences`/`top_k` or tool_use /
    tool_result / thinking blocks → messages; anything else (not JSON too) → chat."""
    if not isinstance(body, dict):
        return "chat"
    if "input" in body and "messages" not in body:
        return "responses"
    if any(field in body for field in _MESSAGES_ONLY_FIELDS):
        return "messages"
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(block, dict) and block.get("type") in _MESSAGES_ONLY_BLOCKS
            for block in content
        ):
            return "messages"
    return "chat"
