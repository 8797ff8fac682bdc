"""What one `deepwell serve` is configured with, and the command-line options that set it
(the engine's come from deepwell/settings, as for every engine command).

Kept free of heavy imports so that building the `deepwell` parser stays fast.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from deepwell.serve.cluster.options import add_cluster_arguments, positive_int
from deepwell.settings import environment
from deepwell.settings.durations import parse_duration
from deepwell.settings.flags import add_engine_arguments, add_parallel_arguments
from deepwell.settings.model_source import model_argument

# The environment variable that also sets an API key (as vLLM's VLLM_API_KEY does).
API_KEY_ENV = environment.register(
    "DEEPWELL_API_KEY", "one more API key serve accepts, beside --api-key", environment.parse_text
)


@dataclass(frozen=True)
class ImageSettings:
    """What a request's images may be and where their bytes may come from."""

    # serve --limit-mm-per-prompt image=N: images one request may carry.
    max_images_per_prompt: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    # Pixels of one decoded image (width x height), checked before decoding.
    max_image_pixels: int = 40_000_000
    # Hosts remote http(s) images may come from; empty: none.
    allowed_media_domains: tuple[str, ...] = ()
    # `file://` images are read only under this directory; None: none.
    allowed_local_media_path: Path | None = None
    media_fetch_timeout_s: float = 10.0


# The multimodal preprocessing pool (serve/images/pool.py), as DeepInfer's switches name it.
USE_POOL_ENV = environment.register(
    "DEEPWELL_USE_MULTIMODAL_POOL",
    "decode and resize request images in a process pool (default on; 0 runs them in the "
    "request's thread)",
    environment.parse_flag,
    default=True,
)
POOL_SIZE_ENV = environment.register(
    "DEEPWELL_MULTIMODAL_POOL_SIZE",
    "processes of the multimodal pool (default: 2, at most the CPUs)",
    environment.parse_int,
)


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
    # Requests that may wait for their first token at once; beyond it a request gets 503
    # with Retry-After (None: no bound but the pending limit).
    max_waiting_requests: int | None = None
    # Seconds a generation request may run before it is aborted in the engine, its KV
    # blocks freed and the client answered 408 (None: no deadline).
    request_timeout_s: float | None = None
    # Quota guard (spec/deepinfer.md §5): a worker may leave only while the others would
    # stay at or below this KV utilisation; its requests get drain_timeout_s to finish.
    drain_max_utilisation: float = 0.8
    drain_timeout_s: float = 60.0
    # Gateway: prompt + completion tokens one API key may use per minute (None: no limit).
    key_tokens_per_minute: int | None = None
    # The sampling seed of requests that bring none (serve --seed); None: a random one each.
    default_seed: int | None = None
    # Serve the static page at /playground (its API calls still need a key).
    playground: bool = True
    # Serve the API's description at /openapi.json and its page at /docs (--disable-docs).
    docs: bool = True
    images: ImageSettings = field(default_factory=ImageSettings)
    # Stored Responses (`store: true`): where (sqlite:///PATH; an app built in-process
    # keeps them in memory), for how long, and how many at most.
    responses_store: str = "sqlite:///:memory:"
    responses_ttl_s: float = 30 * 24 * 3600.0
    responses_max: int = 100_000
    # Operations (issue 34): browser origins allowed by CORS (empty: CORS off), and whether
    # the request log carries the prompt.
    allowed_origins: tuple[str, ...] = ()
    log_prompts: bool = False


# deepwell.recipe.stream.json_calls' formats, named here to keep the parser's imports light.
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `deepwell serve`, grouped as `--help` shows them."""
    groups = add_engine_arguments(parser)
    add_parallel_arguments(parser)
    add_cluster_arguments(parser)
    _add_model_names(parser, groups.model)
    _add_http_arguments(parser.add_argument_group("HTTP server"))
    _add_image_arguments(parser.add_argument_group("images in requests"))
    _add_prompt_arguments(
        parser.add_argument_group("chat templates and tool calls (non-DeepSeek models)")
    )
    _add_responses_arguments(parser.add_argument_group("stored responses (/v1/responses)"))
    _add_operations_arguments(parser.add_argument_group("operations: shutdown, logs, CORS"))


def _add_model_names(parser: argparse.ArgumentParser, model: argparse._ArgumentGroup) -> None:
    """The model as a positional argument, and the names clients call it by."""
    # vLLM's spelling, `deepwell serve MODEL`; `--model PATH` still works.
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        type=model_argument(),
        help="a .gguf file, a model directory or a Hugging Face repo id ORG/NAME (the same "
        "as --model)",
    )
    model.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the name(s) clients send as `model` (default: the directory's or file's name)",
    )


def _add_http_arguments(http: argparse._ArgumentGroup) -> None:
    """Where and how the HTTP process listens, whom it admits and how much."""
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    http.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"accept this key (repeatable; also ${API_KEY_ENV}); without one, no authentication",
    )
    http.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed of requests that bring none (default: a random one per request)",
    )
    defaults = ServeSettings()
    http.add_argument(
        "--no-playground",
        action="store_true",
        help="do not serve the browser playground at /playground",
    )
    http.add_argument(
        "--disable-docs",
        action="store_true",
        help="do not serve the API's OpenAPI description (/openapi.json) and its page (/docs)",
    )
    http.add_argument(
        "--key-tokens-per-minute",
        type=int,
        default=None,
        help="per API key, prompt + completion tokens per minute; beyond it 429 with "
        "Retry-After (default: no limit)",
    )
    http.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.max_body_bytes,
        help=f"largest request body (default: {defaults.max_body_bytes})",
    )
    http.add_argument(
        "--max-pending-requests",
        type=int,
        default=defaults.max_pending_requests,
        help="requests admitted at once; more get 429 with Retry-After "
        f"(default: {defaults.max_pending_requests})",
    )
    http.add_argument(
        "--max-waiting-requests",
        type=positive_int,
        default=defaults.max_waiting_requests,
        metavar="N",
        help="requests that may wait for their first token at once; more get 503 with "
        "Retry-After in the dialect's error shape (default: no bound beyond "
        "--max-pending-requests)",
    )
    http.add_argument(
        "--request-timeout",
        type=parse_duration,
        default=defaults.request_timeout_s,
        metavar="SECONDS",
        help="deadline of one generation request (seconds, or a number with s/m/h): past it "
        "the request is aborted in the engine, its KV blocks freed however slowly its client "
        "reads, and it ends with 408 (an error event once streaming) (default: none)",
    )
    http.add_argument(
        "--mock", action="store_true", help="serve the fixed reply 'Hello world!' with no model"
    )
    http.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: info)",
    )


def _add_image_arguments(images: argparse._ArgumentGroup) -> None:
    """How many images a request may carry, how large, and where they may come from."""
    defaults = ImageSettings()
    images.add_argument(
        "--limit-mm-per-prompt",
        type=images_per_prompt,
        default=defaults.max_images_per_prompt,
        metavar="image=N",
        help='images one request may carry, as image=N or JSON {"image": N} '
        f"(default: {defaults.max_images_per_prompt})",
    )
    images.add_argument(
        "--max-image-bytes",
        type=int,
        default=defaults.max_image_bytes,
        help=f"largest image file, in bytes (default: {defaults.max_image_bytes})",
    )
    images.add_argument(
        "--max-image-pixels",
        type=int,
        default=defaults.max_image_pixels,
        help="largest image, width x height in pixels, checked before it is decoded "
        f"(default: {defaults.max_image_pixels})",
    )
    images.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="hosts whose http(s) image URLs the server fetches (redirects are checked "
        "again); without it, remote image URLs are refused",
    )
    images.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        help="read file:// image URLs under DIR; without it, local files are refused",
    )
    images.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=defaults.media_fetch_timeout_s,
        help=f"seconds one remote image may take (default: {defaults.media_fetch_timeout_s:g})",
    )


def images_per_prompt(text: str) -> int:
    """`--limit-mm-per-prompt`: `image=N` or vLLM's JSON `{"image": N}`."""
    if text.lstrip().startswith("{"):
        try:
            limits = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from None
    else:
        key, _, value = text.partition("=")
        limits = {key.strip(): value.strip()}
    if not isinstance(limits, dict) or set(limits) != {"image"}:
        raise argparse.ArgumentTypeError(
            f'give the image limit as image=N or {{"image": N}}, got {text!r} '
            "(images are the only media served)"
        )
    try:
        limit = int(limits["image"])
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"the image limit must be an integer, got {text!r}"
        ) from None
    if limit < 0:
        raise argparse.ArgumentTypeError(f"the image limit must be 0 or more, got {limit}")
    return limit


def image_settings(args: argparse.Namespace) -> ImageSettings:
    local = args.allowed_local_media_path
    if local is not None and not Path(local).is_dir():
        raise ValueError(f"--allowed-local-media-path {local}: not a directory")
    return ImageSettings(
        max_images_per_prompt=args.limit_mm_per_prompt,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        allowed_media_domains=tuple(args.allowed_media_domains),
        allowed_local_media_path=None if local is None else Path(local),
        media_fetch_timeout_s=args.media_fetch_timeout,
    )


def _add_prompt_arguments(prompts: argparse._ArgumentGroup) -> None:
    """How a model without DeepSeek's encoding renders prompts and writes tool calls."""
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


# Where `deepwell serve` keeps stored responses unless told otherwise.
DEFAULT_RESPONSES_STORE = "sqlite:///~/.cache/deepwell/responses.sqlite3"


def _add_responses_arguments(responses: argparse._ArgumentGroup) -> None:
    """Where the responses a client stores (`store: true`) are kept, and for how long."""
    defaults = ServeSettings()
    responses.add_argument(
        "--responses-store",
        default=DEFAULT_RESPONSES_STORE,
        metavar="URL",
        help="SQLite database of stored responses, sqlite:///PATH (one file, shared by every "
        "server process and kept across restarts; sqlite:///:memory: keeps them in this "
        f"process only) (default: {DEFAULT_RESPONSES_STORE})",
    )
    responses.add_argument(
        "--responses-ttl",
        type=float,
        default=defaults.responses_ttl_s,
        metavar="SECONDS",
        help="a stored response is forgotten this long after it was created "
        f"(default: {defaults.responses_ttl_s:.0f}, 30 days)",
    )
    responses.add_argument(
        "--responses-max",
        type=int,
        default=defaults.responses_max,
        metavar="N",
        help=f"keep at most N stored responses, the oldest go first (default: "
        f"{defaults.responses_max})",
    )


def _add_operations_arguments(operations: argparse._ArgumentGroup) -> None:
    """How the server stops, what it logs per request, and which browser origins it serves."""
    operations.add_argument(
        "--shutdown-timeout",
        "--shutdown-grace",  # the earlier spelling
        dest="shutdown_timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT new requests get 503 and running ones get this long to "
        "finish; the rest then end with the dialect's error event (default: 10)",
    )
    operations.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="log lines as readable text or as one JSON object each (default: text)",
    )
    operations.add_argument(
        "--log-prompts",
        action="store_true",
        help="add each request's prompt to its request log line (default: never logged)",
    )
    operations.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="browser origins (https://app.example.com, or *) allowed to call the API across "
        "origins (CORS); without it, no CORS headers are sent",
    )


LOG_FORMATS = ("text", "json")


def api_keys(flags: list[str], environ: Mapping[str, str]) -> tuple[str, ...]:
    """The accepted keys: every --api-key, and DEEPWELL_API_KEY when set."""
    from_env = environment.read(API_KEY_ENV, environ)
    return tuple(dict.fromkeys([*flags, *([from_env] if from_env else [])]))


def model_path(args: argparse.Namespace) -> str | None:
    """The model to serve, from `MODEL` or `--model` (which must then agree)."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag} and --model {args.model}")
    return args.model_tag or args.model
