"""Offline benchmark: N requests with seeded random input/output lengths, ignore_eos.

Reports prefill and decode tok/s, avg_SPS (steps per second), TTFT/TPOT percentiles and
peak RSS; `decode_num_requests=1` runs requests one at a time (latency mode).
"""

import dataclasses
import json
import random
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from deepwell.engine.args import EngineArgs
from deepwell.engine.core import EngineCore
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.stats import EngineStats


@dataclass
class BenchConfig:
    num_requests: int = 64
    input_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (64, 256)
    # Requests decoding at once (the engine's max_num_seqs); 1 = latency mode.
    decode_num_requests: int = 64
    seed: int = 0
    # Tokens of one random prefix every prompt starts with (0 = none): prefix-cache traffic.
    shared_prefix: int = 0


@dataclass
class BenchResult:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    # Prompt tokens over the time of steps that ran prefill work.
    prefill_tok_s: float
    # Output tokens over the time of steps that ran only decodes.
    decode_tok_s: float
    output_tok_s: float
    avg_sps: float
    # Model work (forward, logits, sampling) over the wall time: the rest is the step
    # loop's own bookkeeping that asynchronous scheduling did not hide.
    busy_fraction: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    peak_rss_mib: float
    num_preemptions: int
    # Prompt tokens the prefix cache supplied over those looked up.
    prefix_hit_rate: float = 0.0
    # Speculative decoding: draft tokens accepted over verified, per draft position, tokens
    # a request gains per decode step, and the mean error of the survival estimates.
    spec_accept_rate: float = 0.0
    spec_position_accept_rates: tuple[float, ...] = ()
    spec_tokens_per_decode: float = 0.0
    spec_confidence_error: float = 0.0


def random_requests(config: BenchConfig, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(config.seed)
    # Ids below 17 are SmolLM2's control tokens; keep prompts to ordinary text ids.
    shared = [rng.randrange(17, vocab_size) for _ in range(config.shared_prefix)]
    requests = []
    for _ in range(config.num_requests):
        prompt_len = rng.randint(*config.input_len)
        output_len = rng.randint(*config.output_len)
        prompt = shared + [rng.randrange(17, vocab_size) for _ in range(prompt_len)]
        requests.append((prompt, output_len))
    return requests


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0], "mean": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98], "mean": statistics.fmean(values)}


def run_bench(engine_args: EngineArgs, config: BenchConfig, progress: bool = True) -> BenchResult:
    core = EngineCore(dataclasses.replace(engine_args, max_num_seqs=config.decode_num_requests))
    requests = random_requests(config, core.vocab_size)
    # Warm up allocator and kernels outside the measurement.
    core.add_request("warmup", requests[0][0][:16], SamplingParams(max_tokens=4, temperature=0))
    while core.has_unfinished():
        core.step()
    core.num_steps = 0
    before = core.stats()
    compute_before = core.compute_s

    start = time.perf_counter()
    for index, (prompt, output_len) in enumerate(requests):
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        core.add_request(str(index), prompt, params)
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    prefill_time = decode_time = 0.0
    with tqdm(total=len(requests), desc="bench", unit="req", disable=not progress) as bar:
        while core.has_unfinished():
            step_start = time.perf_counter()
            outputs = core.step()
            now = time.perf_counter()
            if core.last_step.prefill_tokens:
                prefill_time += now - step_start
            else:
                decode_time += now - step_start
            for output in outputs:
                first_token.setdefault(output.request_id, now)
                if output.finished:
                    finished[output.request_id] = now
                    bar.update(1)
    elapsed = time.perf_counter() - start
    core.close()
    spec = core.stats().spec

    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(n for _, n in requests)
    decode_only_tokens = sum(n - 1 for i, (_, n) in enumerate(requests) if str(i) in finished)
    ttft = [(first_token[str(i)] - start) * 1e3 for i in range(len(requests))]
    tpot = [
        (finished[str(i)] - first_token[str(i)]) * 1e3 / (n - 1)
        for i, (_, n) in enumerate(requests)
        if n > 1
    ]
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_rss_mib = rss / 2**20 if sys.platform == "darwin" else rss / 1024
    return BenchResult(
        num_requests=len(requests),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        elapsed_s=elapsed,
        prefill_tok_s=prompt_tokens / prefill_time if prefill_time else 0.0,
        decode_tok_s=decode_only_tokens / decode_time if decode_time else 0.0,
        output_tok_s=output_tokens / elapsed,
        avg_sps=core.num_steps / elapsed,
        busy_fraction=(core.compute_s - compute_before) / elapsed,
        ttft_ms=percentiles(ttft),
        tpot_ms=percentiles(tpot),
        peak_rss_mib=peak_rss_mib,
        num_preemptions=core.num_preemptions,
        prefix_hit_rate=_hit_rate(before, core.stats()),
        spec_accept_rate=spec.accept_rate,
        spec_position_accept_rates=spec.position_accept_rates,
        spec_tokens_per_decode=spec.tokens_per_decode,
        spec_confidence_error=spec.confidence_error,
    )


def _hit_rate(before: EngineStats, after: EngineStats) -> float:
    queried = after.prefix_queried_tokens - before.prefix_queried_tokens
    return (after.prefix_hit_tokens - before.prefix_hit_tokens) / queried if queried else 0.0


def format_result(result: BenchResult) -> str:
    def pct(values: dict[str, float]) -> str:
        return "  ".join(f"{k} {v:.1f}" for k, v in values.items())

    return "\n".join(
        [
            f"requests          {result.num_requests} ({result.prompt_tokens} prompt, "
            f"{result.output_tokens} output tokens) in {result.elapsed_s:.1f} s",
            f"prefill tok/s     {result.prefill_tok_s:.1f}",
            f"decode tok/s      {result.decode_tok_s:.1f}",
            f"output tok/s      {result.output_tok_s:.1f}",
            f"avg_SPS           {result.avg_sps:.2f}",
            f"model busy        {result.busy_fraction:.1%} of the wall time",
            f"TTFT ms           {pct(result.ttft_ms)}",
            f"TPOT ms           {pct(result.tpot_ms)}",
            f"peak RSS MiB      {result.peak_rss_mib:.0f}",
            f"preemptions       {result.num_preemptions}",
            f"prefix hit rate   {result.prefix_hit_rate:.1%}",
            f"spec accept rate  {result.spec_accept_rate:.1%} (per position "
            f"{' '.join(f'{r:.2f}' for r in result.spec_position_accept_rates)}), "
            f"{result.spec_tokens_per_decode:.2f} tokens per decode step, "
            f"confidence error {result.spec_confidence_error:.3f}",
        ]
    )


def write_result(path: Path, engine_args: EngineArgs, config: BenchConfig, result: BenchResult):
    payload = {
        "engine_args": asdict(engine_args),
        "config": asdict(config),
        "result": asdict(result),
    }
    path.write_text(json.dumps(payload, indent=2))
