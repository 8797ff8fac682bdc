"""Run a request through a recipe implementation and summarise what came out.

Works on `deepwell.recipe` and on the `deepseek_recipe` oracle alike (same public names), in the
shape tests/data/recipe_vectors.json records.
"""

from __future__ import annotations

import copy
import json
from types import ModuleType


def error_record(recipe: ModuleType, error: BaseException) -> dict:
    record = {"class": type(error).__name__, "message": str(error)}
    if isinstance(error, recipe.ConversionError):
        record["status_code"] = error.status_code
        record["body"] = json.loads(error.body)
    return record


def _source(s) -> dict:
    return {
        "kind": s.kind,
        "detail": s.detail,
        "path": s.path,
        "data_url": s.data_url,
        "url": s.url,
        "data_hex": s.data.hex() if s.data is not None else None,
    }


def _tool(t) -> dict:
    return {
        "name": t.name,
        "description": t.description,
        "parameters": t.parameters,
        "strict": t.strict,
        "defer_loading": t.defer_loading,
    }


def _message(m) -> dict:
    d = {"role": m.role, "content": m.content}
    if m.role == "assistant":
        d["reasoning_content"] = m.reasoning_content
        d["tool_calls"] = (
            None
            if m.tool_calls is None
            else [{"id": t.id, "name": t.name, "arguments": t.arguments} for t in m.tool_calls]
        )
        d["prefix"] = m.prefix
    if m.role == "tool":
        d["tool_call_id"] = m.tool_call_id
    if m.image_sources:
        d["image_sources"] = [_source(s) for s in m.image_sources]
    if m.role == "system" and m.tools is not None:
        d["tools"] = [_tool(t) for t in m.tools]
    return d


def _enum_name(value) -> str | None:
    return None if value is None else str(value).split(".")[-1]


def request_summary(r) -> dict:
    c = r.conversation
    io = r.inference_options
    oc = io.output_constraint
    po = r.parsing_options
    return {
        "model_version": _enum_name(r.model_version),
        "stream": r.stream,
        "conversation": {
            "messages": [_message(m) for m in c.messages],
            "thinking_mode": c.thinking_mode,
            "tools": [_tool(t) for t in c.tools],
            "tool_choice": c.tool_choice,
            "reasoning_effort": c.reasoning_effort,
            "response_format": c.response_format,
            "response_schema": c.response_schema,
            "response_regex": c.response_regex,
        },
        "inference_options": {
            "max_tokens": io.max_tokens,
            "temperature": io.temperature,
            "top_p": io.top_p,
            "logprobs": io.logprobs,
            "top_logprobs": io.top_logprobs,
            "seed": io.seed,
            "output_constraint": None if oc is None else {"kind": oc.kind, "schema": oc.schema},
        },
        "parsing_options": {
            "parse_tool_calls": po.parse_tool_calls,
            "starts_in_tool_calls": po.starts_in_tool_calls,
            "parse_json_output": po.parse_json_output,
            "thinking_initial_stage": _enum_name(po.thinking_initial_stage),
            "stop_sequences": po.stop_sequences,
        },
    }


def options_from(recipe: ModuleType, spec: dict | None):
    o = recipe.ConversionOptions()
    spec = spec or {}
    if "default_thinking_mode" in spec:
        o = o.with_default_thinking_mode(spec["default_thinking_mode"])
    if spec.get("reasoning_content_behavior") == "Reject":
        o = o.with_reasoning_content_behavior(recipe.ReasoningContentBehavior.Reject)
    if "responses_web_search" in spec:
        o = o.with_responses_web_search(
            getattr(recipe.WebSearchBehavior, spec["responses_web_search"])
        )
    if "messages_web_search" in spec:
        o = o.with_messages_web_search(
            getattr(recipe.WebSearchBehavior, spec["messages_web_search"])
        )
    if "thinking_max_tokens_upper_bound" in spec:
        o = o.with_thinking_max_tokens_upper_bound(spec["thinking_max_tokens_upper_bound"])
    if "non_thinking_max_tokens_upper_bound" in spec:
        o = o.with_non_thinking_max_tokens_upper_bound(spec["non_thinking_max_tokens_upper_bound"])
    for name, version in spec.get("model_alias", {}).items():
        o = o.with_model_alias(name, getattr(recipe.ModelVersion, version))
    return o


REQUEST_CLASSES = {
    "chat": "ChatCompletionRequest",
    "responses": "ResponsesRequest",
    "messages": "MessagesRequest",
}


def convert_case(recipe: ModuleType, dialect: str, body, opts_spec: dict | None = None):
    """(record, ConversationRequest or None), recorded like the vectors' conversion cases."""
    cls = getattr(recipe, REQUEST_CLASSES[dialect])
    rec: dict = {}
    try:
        req = cls(copy.deepcopy(body) if not isinstance(body, (str, bytes)) else body)
    except Exception as e:  # noqa: BLE001 - any exception is part of the record
        rec["error"] = {"stage": "construct", **error_record(recipe, e)}
        return rec, None
    rec["model_property"] = req.model
    if dialect == "responses":
        try:
            rec["namespace_tool_map"] = {
                k: list(v)
                for k, v in req.namespace_tool_map(options_from(recipe, opts_spec)).items()
            }
        except Exception as e:  # noqa: BLE001
            rec["namespace_tool_map"] = {"error": error_record(recipe, e)}
        e = req.echo()
        rec["echo"] = {
            "instructions": e.instructions,
            "max_output_tokens": e.max_output_tokens,
            "temperature": e.temperature,
            "top_p": e.top_p,
            "top_logprobs": e.top_logprobs,
            "user": e.user,
        }
    try:
        conv = req.convert(options_from(recipe, opts_spec))
    except Exception as e:  # noqa: BLE001
        rec["error"] = {"stage": "convert", **error_record(recipe, e)}
        return rec, None
    rec["converted"] = request_summary(conv)
    return rec, conv
