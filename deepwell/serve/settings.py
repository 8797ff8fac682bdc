"""What one `deepwell serve` is configured with, and the command-line options that set it.

Kept free of heavy imports so that building the `deepwell` parser stays fast.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from deepwell import engine_defaults
from deepwell.engine_options import add_engine_arguments
from deepwell.serve.cluster.options import add_cluster_arguments


@dataclass(frozen=True)
class ServeSettings:
    """Limits and credentials of one HTTP process."""

    # Empty: no authentication.
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 32 * 1024 * 1024
    # Requests admitted at once (running, queued in the engine, or being converted);
    # beyond it a request gets 429 with Retry-After instead of an unbounded wait.
    max_pending_requests: int = 1024
    retry_after_seconds: int = 1
    # Quota guard (spec/deepinfer.md §5): a worker may leave only while the others would
    # stay at or below this KV utilisation; its requests get drain_timeout_s to finish.
    drain_max_utilisation: float = 0.8
    drain_timeout_s: float = 60.0
    # Gateway: prompt + completion tokens one API key may use per minute (None: no limit).
    key_tokens_per_minute: int | None = None
    # Serve the static page at /playground (its API calls still need a key).
    playground: bool = True


# deepwell.recipe.stream.json_calls' formats, named here to keep the parser's imports light.
TOOL_CALL_PARSERS = ("hermes", "llama3_json")

_SECONDS_PER = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in '3600', '90s', '30m', '12h' or '7d'."""
    unit = text[-1:].lower()
    number = text[:-1] if unit in _SECONDS_PER else text
    try:
        seconds = float(number) * _SECONDS_PER.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r}") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be positive, got {text!r}")
    return seconds


def _days(seconds: float) -> str:
    return f"{seconds / _SECONDS_PER['d']:g}d"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `deepwell serve`."""
    add_engine_arguments(parser)
    add_cluster_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accept this key (repeatable); without one, no authentication",
    )
    parser.add_argument(
        "--mock", action="store_true", help="serve the fixed reply 'Hello world!' with no model"
    )
    parser.add_argument(
        "--no-playground",
        action="store_true",
        help="do not serve the browser playground at /playground",
    )
    defaults = ServeSettings()
    parser.add_argument(
        "--key-tokens-per-minute",
        type=int,
        default=None,
        help="per API key, prompt + completion tokens per minute; beyond it 429 with "
        "Retry-After (default: no limit)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=defaults.max_pending_requests,
        help="requests admitted at once; more get 429 with Retry-After",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish on shutdown before being aborted",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=engine_defaults.MAX_NUM_SEQS,
        help="engine batch size limit",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context limit (default: the model's)"
    )
    parser.add_argument(
        "--kv-store-capacity-gib",
        type=float,
        default=engine_defaults.KV_STORE_CAPACITY_GIB,
        help="size beyond which the KV store evicts the soonest-expiring blocks "
        f"(default: {engine_defaults.KV_STORE_CAPACITY_GIB:g})",
    )
    parser.add_argument(
        "--kv-store-ttl-chat",
        type=parse_duration,
        default=engine_defaults.KV_STORE_TTL_CHAT_S,
        metavar="DURATION",
        help="how long a chat request's blocks outlive their last use: seconds, or a number "
        f"with s/m/h/d (default: {_days(engine_defaults.KV_STORE_TTL_CHAT_S)})",
    )
    parser.add_argument(
        "--kv-store-ttl-agent",
        type=parse_duration,
        default=engine_defaults.KV_STORE_TTL_AGENT_S,
        metavar="DURATION",
        help="the same for agent requests (header x-deepwell-cache-class: agent; "
        f"default: {_days(engine_defaults.KV_STORE_TTL_AGENT_S)})",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    prompts = parser.add_argument_group("chat templates and tool calls (non-DeepSeek models)")
    prompts.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template to render prompts with, instead of the model's own",
    )
    prompts.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>, Qwen and "
        "others) or llama3_json; without it, requests with tools are refused",
    )
