"""The `deepwell` command line: one small function per subcommand, all listed in COMMANDS.

Subcommands import what they need when they run, so `deepwell render` never loads torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from deepwell.recipe.dialects.detect import DIALECTS, detect_dialect
from deepwell.settings import sweep as sweep_defaults
from deepwell.settings.engine import BLOCK_SIZE
from deepwell.settings.flags import (
    add_engine_arguments,
    add_parallel_arguments,
    engine_args_from,
    given,
)
from deepwell.settings.model_source import CONFIG_FILES, model_argument
from deepwell.settings.parallel import ParallelConfig


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, one-line help, how it adds its arguments, what it runs."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# --- render ---

# ANSI bold cyan around control tokens when stdout is a terminal.
_HIGHLIGHT_ON, _HIGHLIGHT_OFF = "\x1b[1;36m", "\x1b[0m"


def _configure_render(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        nargs="?",
        default="-",
        metavar="FILE|-",
        help="request body as JSON (default: read standard input)",
    )
    parser.add_argument(
        "--dialect",
        choices=DIALECTS,
        help="request dialect (default: from the body: `input` → responses; a top-level "
        "`system`/`stop_sequences`/`top_k` or tool_use/tool_result/thinking blocks → "
        "messages; otherwise chat)",
    )
    parser.add_argument(
        "--v41",
        action="store_true",
        help="render with the DeepSeek V4.1 encoding whatever the model (default: the "
        "encoding of the request's model)",
    )
    parser.add_argument(
        "--ids", action="store_true", help="print token ids (a JSON list) instead of the text"
    )
    parser.add_argument(
        "--tokenizer", metavar="PATH", help="tokenizer.json to encode with (needed by --ids)"
    )


def highlight(prompt: str, special_ranges: list[tuple[int, int]]) -> str:
    """The prompt with each control token wrapped in ANSI colour."""
    out: list[str] = []
    at = 0
    for start, end in special_ranges:
        out += [prompt[at:start], _HIGHLIGHT_ON, prompt[start:end], _HIGHLIGHT_OFF]
        at = end
    out.append(prompt[at:])
    return "".join(out)


def _read_input(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, encoding="utf-8") as file:
        return file.read()


def _error_body(dialect: str, message: str) -> str:
    from deepwell.serve.errors import ErrorShape, error_object

    shape = ErrorShape.ANTHROPIC if dialect == "messages" else ErrorShape.OPENAI
    return json.dumps(error_object(shape, 400, message), ensure_ascii=False)


def _run_render(args: argparse.Namespace) -> int:
    from deepwell import recipe

    if args.ids and not args.tokenizer:
        print("deepwell render: --ids needs --tokenizer PATH", file=sys.stderr)
        return 2
    try:
        text = _read_input(args.file)
    except OSError as error:
        print(f"deepwell render: {error}", file=sys.stderr)
        return 2
    if args.dialect:
        dialect = args.dialect
    else:
        try:
            dialect = detect_dialect(json.loads(text))
        except ValueError:
            dialect = "chat"  # the request class reports the syntax error below
    request_class = {
        "chat": recipe.ChatCompletionRequest,
        "responses": recipe.ResponsesRequest,
        "messages": recipe.MessagesRequest,
    }[dialect]
    try:
        converted = request_class(text).convert(recipe.ConversionOptions())
    except recipe.ConversionError as error:
        body = error.body if dialect != "messages" else _error_body(dialect, error.message)
        print(body, file=sys.stderr)
        return 2
    except ValueError as error:
        print(_error_body(dialect, str(error)), file=sys.stderr)
        return 2
    v41 = args.v41 or converted.model_version is recipe.ModelVersion.DeepseekV41Flash
    encoding = recipe.DeepseekV41Encoding() if v41 else recipe.DeepseekV4Encoding()
    if args.ids:
        try:
            tokenizer = recipe.Tokenizer.from_file(args.tokenizer)
            ids = encoding.with_tokenizer(tokenizer).encode(converted.conversation)
        except RuntimeError as error:  # unreadable tokenizer, or a control token it lacks
            print(f"deepwell render: {error}", file=sys.stderr)
            return 1
        print(json.dumps(ids))
        return 0
    rendered = encoding.render_conversation(converted.conversation)
    _write_prompt(sys.stdout, rendered.prompt, rendered.special_ranges)
    return 0


def _write_prompt(stream: TextIO, prompt: str, special_ranges: list[tuple[int, int]]) -> None:
    if stream.isatty():
        prompt = highlight(prompt, special_ranges)
    stream.write(prompt)
    if stream.isatty():
        stream.write("\n")


# --- tokenize ---


def _configure_tokenize(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "text",
        nargs="?",
        default="-",
        metavar="TEXT|-",
        help="text to tokenize, or ids to decode with --decode (default: standard input)",
    )
    parser.add_argument("--tokenizer", metavar="PATH", required=True, help="tokenizer.json")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--plain",
        action="store_true",
        help="tokenize with the added vocabulary removed, as prompt text is "
        "(control-token spellings stay ordinary text)",
    )
    mode.add_argument(
        "--decode",
        action="store_true",
        help="read token ids (JSON list or whitespace-separated) and print the text",
    )


def _run_tokenize(args: argparse.Namespace) -> int:
    from deepwell.recipe import Tokenizer

    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        tokenizer = Tokenizer.from_file(args.tokenizer)
    except RuntimeError as error:
        print(f"deepwell tokenize: {error}", file=sys.stderr)
        return 1
    if args.decode:
        stripped = text.strip()
        ids = json.loads(stripped) if stripped.startswith("[") else [int(t) for t in text.split()]
        sys.stdout.write(tokenizer.decode(ids))
        return 0
    ids = tokenizer.encode_plain([text])[0] if args.plain else tokenizer.encode(text)
    print(json.dumps(ids))
    return 0


# --- serve ---


def _configure_serve(parser: argparse.ArgumentParser) -> None:
    from deepwell.serve.settings import add_arguments

    add_arguments(parser)


def _run_serve(args: argparse.Namespace) -> int:
    from deepwell.serve.launcher import run

    return run(args)


def _configure_drain(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("worker", type=int, help="the worker's id (see GET /admin/workers)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the serving front end")
    parser.add_argument("--api-key", help="one of the server's --api-key values")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the drain"
    )


def _run_drain(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = f"{args.url.rstrip('/')}/admin/workers/{args.worker}/drain"
    try:
        response = httpx.post(url, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as error:
        print(f"deepwell drain: {error}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"deepwell drain: {response.json()['error']['message']}", file=sys.stderr)
        return 1
    result = response.json()
    print(
        f"worker {result['worker_id']} drained: {result['finished']} requests finished on it, "
        f"{result['migrated']} moved; the others are at "
        f"{result['remaining_utilisation']:.0%} utilisation"
    )
    return 0


def _configure_worker(parser: argparse.ArgumentParser) -> None:
    from deepwell.serve.cluster.remote_worker import configure

    configure(parser)


def _run_worker(args: argparse.Namespace) -> int:
    from deepwell.serve.cluster.remote_worker import run

    return run(args)


# --- generate ---


def _loading_line(engine_args) -> str:
    choice = engine_args.dtype_choice
    return f"loading model … (dtype {choice.dtype}: {choice.reason})"


def _configure_generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prompt",
        help="the user message (DeepSeek models: rendered with their own chat encoding, "
        "thinking off)",
    )
    parser.add_argument(
        "--raw", action="store_true", help="complete the text as is, without the chat template"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default: 1)")
    parser.add_argument("--seed", type=int, help="sampling seed")
    add_engine_arguments(parser)
    add_parallel_arguments(parser)


def _run_generate(args: argparse.Namespace) -> int:
    from deepwell.engine import EngineError
    from deepwell.engine.build import check_expert_parallel
    from deepwell.engine.parallel import ParallelError
    from deepwell.engine.parallel.launch import run_local_ranks

    try:
        under_torchrun = ParallelConfig.from_torchrun(given(args, ParallelConfig))
        parallel = under_torchrun or ParallelConfig(**given(args, ParallelConfig))
    except ValueError as error:
        print(f"deepwell generate: {error}", file=sys.stderr)
        return 2
    if under_torchrun is not None:
        return _generate(args, under_torchrun)
    if parallel.world_size == 1:
        return _generate(args, parallel)
    if not parallel.expert_parallel:
        print(
            "deepwell generate: one prompt runs on one rank; --data-parallel-size needs "
            "--expert-parallel here (serve spreads requests over data-parallel ranks)",
            file=sys.stderr,
        )
        return 2
    try:
        # Refused here once, not by every rank.
        check_expert_parallel(engine_args_from(args, parallel=parallel))
        run_local_ranks(parallel, _generate_rank, args)
    except (EngineError, ValueError, ParallelError) as error:
        print(f"deepwell generate: {error}", file=sys.stderr)
        return 1
    return 0


def _generate_rank(parallel, args: argparse.Namespace) -> None:
    sys.exit(_generate(args, parallel))


def _generate(args: argparse.Namespace, parallel) -> int:
    """Generate on one rank: rank 0 takes the prompt and prints; the others (expert
    parallelism) compute their experts' share of its steps."""
    from deepwell.engine import LLM, EngineError, SamplingParams
    from deepwell.engine.parallel import ParallelError

    try:
        engine_args = engine_args_from(args, parallel=parallel)
        if parallel.rank == 0:
            print(_loading_line(engine_args), file=sys.stderr, flush=True)
        llm = LLM(**vars(engine_args), decode_sequence=False)
        stop_ids: list[int] = []
        prompt: str | list[int] = args.prompt
        if not args.raw:
            prompt, stop_ids = _chat_prompt(llm, args.prompt)
            if prompt is None:
                print(
                    "deepwell generate: the model has no chat template; use --raw", file=sys.stderr
                )
                return 2
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop_token_ids=[i for i in stop_ids if i is not None],
        )
        if parallel.rank:
            completions = llm.generate(prompt_token_ids=[], sampling_params=params, use_tqdm=False)
        elif isinstance(prompt, str):
            completions = llm.generate(prompt, params, use_tqdm=False)
        else:
            completions = llm.generate(
                prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False
            )
        llm.close()  # writes out the KV store's queue
    except (EngineError, ValueError, ParallelError) as error:
        print(f"deepwell generate: {error}", file=sys.stderr)
        return 1
    if not completions:
        return 0
    (completion,) = completions
    print(completion.text)
    return 0


def _chat_prompt(llm, message: str) -> tuple[str | list[int] | None, list[int]]:
    """The chat-formatted prompt of one user message and the extra stop ids: DeepSeek
    models through their own encoding (token ids, thinking off), others through their
    chat template; None when the model has neither."""
    from deepwell.recipe import (
        ChatTemplateEncoding,
        Conversation,
        ConversionError,
        Tokenizer,
        UserMessage,
    )
    from deepwell.serve.model import deepseek_encoding

    deepseek = deepseek_encoding(llm.core.architecture)
    tokenizer = Tokenizer.from_str(llm.tokenizer.to_str())
    conversation = Conversation([UserMessage(message)], thinking_mode=False)
    if deepseek is not None:
        encoding_type, _ = deepseek
        return encoding_type().with_tokenizer(tokenizer).encode(conversation), []
    if llm.core.chat_template is None:
        return None, []
    bos = llm.core.bos_token_id
    encoding = ChatTemplateEncoding(
        llm.core.chat_template,
        bos_token="" if bos is None else tokenizer.decode([bos]),
        eos_token=tokenizer.decode(sorted(llm.core.eos_token_ids)[:1]),
    ).with_tokenizer(tokenizer)
    try:
        prompt = encoding.encode(conversation)
    except ConversionError as error:
        raise ValueError(error.message) from None
    return prompt, [tokenizer.special_token_id(token) for token in encoding.stop_tokens]


# --- bench ---


def _int_list(text: str) -> tuple[int, ...]:
    """'1,2,4' → (1, 2, 4): positive integers."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def _configure_bench(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--sweep",
        action="store_true",
        help="run over a range of concurrency and of prefill batch sizes; write every point "
        "as JSON and draw two pictures (matplotlib: pip install 'deepwell[plot]')",
    )
    mode.add_argument(
        "--compare",
        nargs="+",
        metavar="SWEEP_JSON",
        help="draw the pictures of these sweep files overlaid (runs nothing)",
    )
    parser.add_argument(
        "--num-requests", type=int, default=64, help="requests to run (default: 64)"
    )
    parser.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="prompt length range, inclusive (default: 64 512; --sweep: one length, "
        "default 128 128)",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="output length range, inclusive; EOS is ignored (default: 64 256; --sweep: one "
        "length, default 32 32)",
    )
    parser.add_argument(
        "--decode-num-requests",
        type=int,
        default=64,
        help="requests decoding at once; 1 = latency mode (default: 64)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="TOKENS",
        help="start every prompt with the same random prefix of this many tokens, so the "
        "prefix cache has work (default: 0, no shared prefix)",
    )
    parser.add_argument("--output-json", metavar="PATH", help="also write the result as JSON here")
    sweep = parser.add_argument_group("--sweep and --compare")
    sweep.add_argument(
        "--concurrency",
        type=_int_list,
        default=sweep_defaults.SWEEP_CONCURRENCY,
        metavar="LIST",
        help="requests decoding together, one point each "
        f"(default: {','.join(map(str, sweep_defaults.SWEEP_CONCURRENCY))})",
    )
    sweep.add_argument(
        "--prefill-batch-tokens",
        type=_int_list,
        default=sweep_defaults.SWEEP_PREFILL_BATCH_TOKENS,
        metavar="LIST",
        help="prompt tokens computed in one step, one point each "
        f"(default: {','.join(map(str, sweep_defaults.SWEEP_PREFILL_BATCH_TOKENS))})",
    )
    sweep.add_argument(
        "--output-dir",
        default="bench-results/sweep",
        metavar="DIR",
        help="where sweep.json and the pictures go (default: bench-results/sweep)",
    )
    sweep.add_argument(
        "--label", help="the run's name in legends (default: model, dtype and commit)"
    )
    add_engine_arguments(parser)


def _run_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.compare:
        return _compare_sweeps([Path(p) for p in args.compare], Path(args.output_dir))
    from deepwell.engine import EngineError
    from deepwell.engine.bench import BenchConfig, format_result, run_bench, write_result

    if args.sweep:
        return _run_sweep(args)
    config = BenchConfig(
        num_requests=args.num_requests,
        input_len=tuple(args.input_len or (64, 512)),
        output_len=tuple(args.output_len or (64, 256)),
        decode_num_requests=args.decode_num_requests,
        seed=args.seed,
        shared_prefix=args.shared_prefix,
    )
    try:
        engine_args = engine_args_from(args)
        print(_loading_line(engine_args), file=sys.stderr, flush=True)
        result = run_bench(engine_args, config)
    except (EngineError, ValueError) as error:
        print(f"deepwell bench: {error}", file=sys.stderr)
        return 1
    print(format_result(result))
    if args.output_json:
        write_result(Path(args.output_json), engine_args, config, result)
    return 0


def _run_sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deepwell.engine import EngineError
    from deepwell.engine.sweep import SweepConfig, run_sweep

    lengths = {"input": args.input_len or (128, 128), "output": args.output_len or (32, 32)}
    for name, (low, high) in lengths.items():
        if low != high:
            print(f"deepwell bench: --sweep takes one {name} length (MIN = MAX)", file=sys.stderr)
            return 2
    try:
        config = SweepConfig(
            concurrency=args.concurrency,
            prefill_batch_tokens=args.prefill_batch_tokens,
            input_len=lengths["input"][0],
            output_len=lengths["output"][0],
            seed=args.seed,
        )
        engine_args = engine_args_from(args)
        print("loading model …", file=sys.stderr, flush=True)
        result = run_sweep(engine_args, config, label=args.label or "")
    except (EngineError, ValueError) as error:
        print(f"deepwell bench: {error}", file=sys.stderr)
        return 1
    if not result.label:
        machine = result.machine
        label = f"{machine.model} {machine.dtype} {machine.commit or ''}".strip()
        result = dataclasses.replace(result, label=label)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "sweep.json"
    json_path.write_text(result.to_json())
    print(f"wrote {json_path}")
    for point in result.decode:
        print(
            f"concurrency {point.concurrency:4d}  {point.decode_tok_s:8.1f} tok/s  "
            f"{point.tok_s_per_user:6.1f} tok/s per user  TTFT p50 {point.ttft_ms_p50:.0f} ms"
        )
    for point in result.prefill:
        print(
            f"prefill {point.batch_tokens:5d} tokens  {point.prefill_tok_s:8.1f} tok/s  "
            f"step {point.step_ms:.1f} ms"
        )
    return _draw([result], out_dir)


def _compare_sweeps(paths: list, out_dir) -> int:
    from deepwell.engine.sweep import SweepResult

    runs = []
    for path in paths:
        try:
            runs.append(SweepResult.from_json(path.read_text()))
        except (OSError, ValueError) as error:
            print(f"deepwell bench: {path}: {error}", file=sys.stderr)
            return 1
    return _draw(runs, out_dir)


def _draw(runs: list, out_dir) -> int:
    from deepwell.engine.sweep_plot import PlotUnavailable, draw

    try:
        paths = draw(runs, out_dir)
    except PlotUnavailable as error:
        print(f"deepwell bench: {error}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    return 0


# --- plan ---


def _configure_plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL_DIR",
        type=model_argument(CONFIG_FILES),
        help="a checkpoint directory (or its config.json), or a Hugging Face repo id ORG/NAME "
        "(only its config.json is fetched): DeepSeek-V4.1, Llama, Qwen2/3; only config.json "
        "is read, no weights or tokenizer",
    )
    parser.add_argument(
        "--memory",
        metavar="SIZE",
        help="memory of the machine: 1TiB, 256GiB, 512G, 1.5T, or a plain number of GiB "
        "(default: this machine's)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="tokens of the longest sequence (default: the model's context)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="sequences to hold at once: reserves their fixed state as the engine does "
        "(default: count how many fit)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=BLOCK_SIZE,
        metavar="N",
        help=f"tokens per KV block (default: {BLOCK_SIZE})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.epilog = "exit status: 0 when it fits, 1 when it does not (and why), 2 on bad input"


def _run_plan(args: argparse.Namespace) -> int:
    from deepwell.engine.errors import ModelLoadError
    from deepwell.engine.plan import parse_size, plan_memory
    from deepwell.engine.plan.table import render_plan

    try:
        memory = parse_size(args.memory) if args.memory else _machine_memory()
        plan = plan_memory(
            args.model,
            memory,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
            memory_flag="--memory" if args.memory else "this machine's",
        )
    except (ModelLoadError, ValueError) as error:
        print(f"deepwell plan: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=2) if args.json else render_plan(plan))
    return 0 if plan.fits else 1


def _machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- tiny-checkpoint ---

# deepwell.engine.models.deepseek_v41.writer.PRESETS, named here so that building the
# parser does not load torch (a test keeps them equal).
TINY_CHECKPOINT_PRESETS = ("tiny", "small", "medium")


def _configure_tiny_checkpoint(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="directory to write (created if needed)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (default: 0)"
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer.json to copy, e.g. DeepSeek's own; the vocabulary and the Engram "
        "sizes follow it (default: a byte-level tokenizer with DeepSeek's control tokens)",
    )
    parser.add_argument(
        "--preset",
        choices=TINY_CHECKPOINT_PRESETS,
        default="tiny",
        help="model size: tiny = the 8-layer, 64-wide config of spec/deepseek_v41.md §1.3 "
        "(every layer kind of the release); small = the same schedule 256 wide; medium = "
        "1024 wide with 160 routed experts, ~1.1 GiB mostly MXFP4, for load and memory "
        "measurements (default: tiny)",
    )
    parser.add_argument(
        "--vision",
        action="store_true",
        help="also write a tiny vision tower (2-layer ViT with 2D RoPE, the aligner, the "
        "image delimiters) and set vision_config, so the checkpoint takes images",
    )


def _run_tiny_checkpoint(args: argparse.Namespace) -> int:
    from deepwell.engine.models.deepseek_v41.writer import (
        DRAWN_STORED_PRESETS,
        PRESETS,
        TINY_VISION_CONFIG,
        write_tiny_checkpoint,
    )

    try:
        written = write_tiny_checkpoint(
            args.dir,
            seed=args.seed,
            text_config=PRESETS[args.preset],
            tokenizer_json=args.tokenizer,
            keep_weights=False,
            draw_stored=args.preset in DRAWN_STORED_PRESETS,
            vision_config=TINY_VISION_CONFIG if args.vision else None,
        )
    except (OSError, ValueError) as error:
        print(f"deepwell tiny-checkpoint: {error}", file=sys.stderr)
        return 1
    text = written.config["text_config"]
    print(
        f"wrote a random DeepSeek-V4.1 checkpoint to {written.path}: "
        f"{written.tensors} tensors, {written.parameters:,} parameters, "
        f"{len(written.shards)} shards, "
        f"vocabulary {text['vocab_size']}, {text['num_hidden_layers']} layers + "
        f"{text['num_nextn_predict_layers']} draft stages"
        f"{', a vision tower' if args.vision else ''} (preset {args.preset}, seed {args.seed})"
    )
    print(f"next: deepwell generate --model {written.path} --raw 'Hello'")
    return 0


# --- switches ---


def _configure_switches(parser: argparse.ArgumentParser) -> None:
    pass


def _run_switches(args: argparse.Namespace) -> int:
    import deepwell.serve.settings  # noqa: F401 (registers serve's variables)
    from deepwell.settings.switches import render

    sys.stdout.write(render())
    return 0


# --- build-kernels ---


def _configure_build_kernels(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--test-paths",
        action="store_true",
        help="also the forced AVX2 / scalar builds of the linear kernels, which only the tests use",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=len(os.sched_getaffinity(0)),
        metavar="N",
        help="kernels built at once, one compiler process each, ~1.4 GB of memory each "
        "(default: this process's CPUs)",
    )


def _run_build_kernels(args: argparse.Namespace) -> int:
    import logging
    import resource
    import time

    from deepwell.engine.layers.decode_kernel import KERNEL_BUILDS, build_kernels

    if args.jobs < 1:
        print(
            f"deepwell build-kernels: --jobs must be at least 1, got {args.jobs}", file=sys.stderr
        )
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    builds = [kernel for kernel in KERNEL_BUILDS if args.test_paths or not kernel.test_only]

    def report(kernel, loaded, seconds: float) -> None:
        state = "ready" if loaded.module is not None else "unavailable, the torch path serves"
        print(f"  {kernel.name}: {state} after {seconds:.1f} s ({loaded.reason})", flush=True)

    def cpu_seconds() -> float:
        used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(usage.ru_utime + usage.ru_stime for usage in used)

    print(f"building {len(builds)} kernels, {args.jobs} at a time", flush=True)
    started, cpu_before = time.monotonic(), cpu_seconds()
    results = build_kernels(builds, args.jobs, report)
    ready = sum(loaded.module is not None for loaded in results.values())
    print(
        f"{ready} of {len(builds)} kernels ready in {time.monotonic() - started:.1f} s "
        f"({cpu_seconds() - cpu_before:.1f} CPU s)"
    )
    return 0


# Every subcommand, in `--help` order. Add one by writing its configure/run pair above and
# one line here.
COMMANDS: list[Command] = [
    Command(
        "serve",
        "serve a model over HTTP: OpenAI Chat Completions and Responses, Anthropic Messages",
        _configure_serve,
        _run_serve,
    ),
    Command(
        "worker",
        "run an engine worker that joins a `deepwell serve --worker-address` front end",
        _configure_worker,
        _run_worker,
    ),
    Command(
        "drain",
        "take a worker of a running `deepwell serve --workers N` out of service, if the "
        "others can carry its load",
        _configure_drain,
        _run_drain,
    ),
    Command(
        "render",
        "show the prompt a request renders to (control tokens highlighted on a terminal)",
        _configure_render,
        _run_render,
    ),
    Command(
        "tokenize",
        "encode text with a tokenizer.json (or decode ids)",
        _configure_tokenize,
        _run_tokenize,
    ),
    Command(
        "generate",
        "answer one chat message with a local model (default: the embedded SmolLM2)",
        _configure_generate,
        _run_generate,
    ),
    Command(
        "bench",
        "offline throughput / latency benchmark on random requests",
        _configure_bench,
        _run_bench,
    ),
    Command(
        "plan",
        "whether a machine can hold a model, from its config.json alone: weights by kind "
        "and encoding, KV per token, sequences that fit",
        _configure_plan,
        _run_plan,
    ),
    Command(
        "switches",
        "the table of environment variables: DeepInfer's DEEPINFER_* and their DEEPWELL_* "
        "twins, deepwell's own, other tools' (docs/switches.md)",
        _configure_switches,
        _run_switches,
    ),
    Command(
        "tiny-checkpoint",
        "write a tiny random DeepSeek-V4.1 checkpoint in the released format",
        _configure_tiny_checkpoint,
        _run_tiny_checkpoint,
    ),
    Command(
        "build-kernels",
        "compile the C++ kernels into torch's extensions cache now, in parallel, instead of "
        "inside the first engine that needs each (an engine falls back to torch without them)",
        _configure_build_kernels,
        _run_build_kernels,
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepwell", description="Serve DeepSeek models behind the OpenAI and Anthropic APIs."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
