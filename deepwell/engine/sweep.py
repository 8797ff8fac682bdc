"""Benchmark sweeps: one engine over a range of concurrency (decode) and of prefill batch
sizes, every point recorded with the machine it ran on, as JSON (`deepwell bench --sweep`).

The model loads once; each point is a fresh seeded workload on the same core.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from deepwell.engine.args import EngineArgs
from deepwell.engine.bench import BenchConfig, random_requests
from deepwell.engine.core import EngineCore
from deepwell.engine.sampling_params import SamplingParams
from deepwell.settings import sweep as sweep_defaults

# Each prefill point cuts its batch into prompts of at most this many tokens.
PREFILL_PROMPT_LEN = 256
# CPU flags that decide the compute dtype and the matmul path (ARCHITECTURE.md, Models).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
SWEEP_FORMAT = 1


@dataclass(frozen=True)
class SweepConfig:
    concurrency: tuple[int, ...] = sweep_defaults.SWEEP_CONCURRENCY
    prefill_batch_tokens: tuple[int, ...] = sweep_defaults.SWEEP_PREFILL_BATCH_TOKENS
    # Every decode request has this prompt and output length (EOS ignored).
    input_len: int = 128
    output_len: int = 32
    # Timed repeats of each prefill point, after one untimed.
    prefill_repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("concurrency", "prefill_batch_tokens"):
            values = getattr(self, name)
            if not values or any(v <= 0 for v in values):
                raise ValueError(f"{name} must be a non-empty list of positive integers")
        if self.input_len <= 0 or self.output_len < 2 or self.prefill_repeats <= 0:
            raise ValueError("input_len > 0, output_len >= 2 and prefill_repeats > 0 are needed")


@dataclass(frozen=True)
class MachineFacts:
    """Where a sweep ran: enough to tell two runs' machines and builds apart."""

    cpu_model: str
    cpu_count: int
    # The CPU_FLAGS this CPU has.
    cpu_flags: tuple[str, ...]
    torch_threads: int
    torch_version: str
    python_version: str
    commit: str | None
    dtype: str
    model: str


@dataclass(frozen=True)
class DecodePoint:
    """`concurrency` requests sent together and decoding together."""

    concurrency: int
    # Output tokens per second of the decode window (all requests decoding, no prefill):
    # the process's rate.
    decode_tok_s: float
    # What one user sees in that window: decode_tok_s / concurrency.
    tok_s_per_user: float
    # All output tokens over the whole point, prefill included.
    output_tok_s: float
    ttft_ms_p50: float
    decode_window_s: float
    elapsed_s: float


@dataclass(frozen=True)
class PrefillPoint:
    """Prompts of `batch_tokens` tokens in all, sent together and computed in one step
    (the engine's token budget is at least the largest batch)."""

    batch_tokens: int
    prefill_tok_s: float
    # Median wall time of the step that computed the batch (and sampled one token each).
    step_ms: float
    steps_per_batch: float


@dataclass(frozen=True)
class SweepResult:
    label: str
    created_at: str
    machine: MachineFacts
    config: SweepConfig
    engine_args: dict
    decode: list[DecodePoint] = field(default_factory=list)
    prefill: list[PrefillPoint] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"format": SWEEP_FORMAT, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> SweepResult:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != SWEEP_FORMAT:
            raise ValueError(f"not a sweep file of format {SWEEP_FORMAT}")
        try:
            machine = data["machine"]
            config = data["config"]
            return cls(
                label=data["label"],
                created_at=data["created_at"],
                machine=MachineFacts(**{**machine, "cpu_flags": tuple(machine["cpu_flags"])}),
                config=SweepConfig(
                    **{
                        **config,
                        "concurrency": tuple(config["concurrency"]),
                        "prefill_batch_tokens": tuple(config["prefill_batch_tokens"]),
                    }
                ),
                engine_args=data["engine_args"],
                decode=[DecodePoint(**point) for point in data["decode"]],
                prefill=[PrefillPoint(**point) for point in data["prefill"]],
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"malformed sweep file: {error}") from None


def run_sweep(
    engine_args: EngineArgs, config: SweepConfig, label: str, progress: bool = True
) -> SweepResult:
    """Decode points (concurrency ascending), then prefill points (batch size ascending)."""
    largest_batch = max(config.prefill_batch_tokens)
    args = dataclasses.replace(
        engine_args,
        max_num_seqs=max(*config.concurrency, -(-largest_batch // PREFILL_PROMPT_LEN)),
        max_num_batched_tokens=max(engine_args.max_num_batched_tokens, largest_batch),
        # Every point's prompts are new; a cache hit would measure the cache, not compute.
        enable_prefix_caching=False,
        kv_store_path=None,
    )
    core = EngineCore(args)
    _warm_up(core)
    total = len(config.concurrency) + len(config.prefill_batch_tokens)
    decode: list[DecodePoint] = []
    prefill: list[PrefillPoint] = []
    try:
        with tqdm(total=total, desc="sweep", unit="point", disable=not progress) as bar:
            for concurrency in sorted(config.concurrency):
                bar.set_postfix_str(f"concurrency {concurrency}")
                decode.append(_decode_point(core, config, concurrency))
                bar.update(1)
            for batch_tokens in sorted(config.prefill_batch_tokens):
                bar.set_postfix_str(f"prefill {batch_tokens} tokens")
                prefill.append(_prefill_point(core, config, batch_tokens))
                bar.update(1)
    finally:
        core.close()
    return SweepResult(
        label=label,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        machine=machine_facts(args, core.model_name),
        config=config,
        engine_args=asdict(args),
        decode=decode,
        prefill=prefill,
    )


def _decode_point(core: EngineCore, config: SweepConfig, concurrency: int) -> DecodePoint:
    """Send `concurrency` requests at once; measure decode from the step that gave the last
    of them its first token to the end, so no prefill work is in the window and every
    request decodes throughout it (equal output lengths)."""
    workload = BenchConfig(
        num_requests=concurrency,
        input_len=(config.input_len, config.input_len),
        output_len=(config.output_len, config.output_len),
        seed=config.seed + concurrency,
    )
    start = time.perf_counter()
    for index, (prompt, output_len) in enumerate(random_requests(workload, core.vocab_size)):
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        core.add_request(f"decode-{concurrency}-{index}", prompt, params)
    first_token: dict[str, float] = {}
    window_start: float | None = None
    window_tokens = 0
    while core.has_unfinished():
        outputs = core.step()
        now = time.perf_counter()
        for output in outputs:
            if window_start is not None:
                window_tokens += len(output.new_token_ids)
            elif output.new_token_ids:
                first_token.setdefault(output.request_id, now)
        if window_start is None and len(first_token) == concurrency:
            window_start = now
    end = time.perf_counter()
    window = end - window_start if window_start is not None else 0.0
    decode_tok_s = window_tokens / window if window > 0 else 0.0
    ttft_ms = sorted((t - start) * 1e3 for t in first_token.values())
    return DecodePoint(
        concurrency=concurrency,
        decode_tok_s=decode_tok_s,
        # Every request decodes through the whole window, at the same pace.
        tok_s_per_user=decode_tok_s / concurrency,
        output_tok_s=concurrency * config.output_len / (end - start),
        ttft_ms_p50=statistics.median(ttft_ms),
        decode_window_s=window,
        elapsed_s=end - start,
    )


def _warm_up(core: EngineCore) -> None:
    """One short request outside any measurement: allocator and kernels."""
    core.add_request("warmup", list(range(17, 33)), SamplingParams(max_tokens=4, temperature=0))
    while core.has_unfinished():
        core.step()


def _prefill_point(core: EngineCore, config: SweepConfig, batch_tokens: int) -> PrefillPoint:
    rng = random.Random(config.seed * 1_000_003 + batch_tokens)
    lengths = [PREFILL_PROMPT_LEN] * (batch_tokens // PREFILL_PROMPT_LEN)
    if batch_tokens % PREFILL_PROMPT_LEN:
        lengths.append(batch_tokens % PREFILL_PROMPT_LEN)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times: list[float] = []
    steps: list[int] = []
    # The first repeat is untimed: it sizes the allocator for this batch.
    for repeat in range(config.prefill_repeats + 1):
        for index, length in enumerate(lengths):
            # Ids below 17 are SmolLM2's control tokens (bench.random_requests).
            prompt = [rng.randrange(17, core.vocab_size) for _ in range(length)]
            core.add_request(f"prefill-{batch_tokens}-{repeat}-{index}", prompt, params)
        # Every request ends at its prefill step (max_tokens=1): steps launched = prefill steps.
        launched = core.num_steps
        start = time.perf_counter()
        while core.has_unfinished():
            core.step()
        if repeat:
            times.append(time.perf_counter() - start)
            steps.append(core.num_steps - launched)
    step_s = statistics.median(times)
    return PrefillPoint(
        batch_tokens=batch_tokens,
        prefill_tok_s=batch_tokens / step_s,
        step_ms=step_s * 1e3 / max(1.0, statistics.fmean(steps)),
        steps_per_batch=statistics.fmean(steps),
    )


def machine_facts(args: EngineArgs, model: str) -> MachineFacts:
    flags: set[str] = set()
    cpu_model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    cpu_model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux: the CPU model from platform, no flags
        pass
    return MachineFacts(
        cpu_model=cpu_model,
        cpu_count=os.cpu_count() or 0,
        cpu_flags=tuple(flag for flag in CPU_FLAGS if flag in flags),
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        commit=_commit(),
        dtype=args.dtype,
        model=model,
    )


def _commit() -> str | None:
    """The source tree's commit (with `-dirty` for local changes); None outside a checkout."""
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return described.stdout.strip() or None
