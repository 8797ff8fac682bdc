"""Batch-1 decode of the embedded SmolLM2 with the native whole-step path (models/
llama_native.py) against the torch path with the same int4 linears, and bf16 unquantised;
then where a native step's time goes.

Each engine (synchronous steps, no speculation, no prefix cache, C++ attention) decodes 128
tokens after a 64-token prompt, as benchmarks/throughput_vs_hf.py measures batch-1 decode:
(time of 129 tokens - time of 1) / 128. The engines run in turn, round after round, so a busy
machine slows all alike; each one's best round is printed. The profile times one native
engine's steps: the C++ call (every layer and the Q8_0 head), compute_logits (which hands
the call's logits back), and the rest of the step (scheduling, metadata, sampling); and the
C++ call's weight stream in GB/s against memory_limit.py's read probe at 1 thread and at the
engine's. Prints the load average.

    .venv/bin/python benchmarks/native_decode.py [--threads 1] [--dtype bfloat16] [--rounds 3]
"""

import argparse
import os
import statistics
import time

import torch
from memory_limit import decode_weight_bytes, read_bandwidth

from deepwell.engine import LLM, SamplingParams

PROMPT = list(range(1000, 1064))


def engines(args) -> dict[str, LLM]:
    common = {
        "enable_prefix_caching": False,
        "num_speculative_tokens": 0,
        "num_threads": args.threads,
        "attention_backend": "cpp",
    }
    return {
        "native int4": LLM(
            dtype=args.dtype,
            quantization="int4",
            native_decode="auto",
            **common,
            decode_sequence=False,
        ),
        "torch int4": LLM(
            dtype=args.dtype,
            quantization="int4",
            native_decode="off",
            **common,
            decode_sequence=False,
        ),
        f"{args.dtype} dense": LLM(dtype=args.dtype, **common, decode_sequence=False),
    }


def seconds(llm: LLM, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    return time.perf_counter() - start


def decode_rates(args, llms: dict[str, LLM]) -> None:
    best: dict[str, float] = {}
    for llm in llms.values():
        seconds(llm, 8)
    for _ in range(args.rounds):
        for name, llm in llms.items():
            first = min(seconds(llm, 1) for _ in range(2))
            rate = args.decode_tokens / (seconds(llm, args.decode_tokens + 1) - first)
            best[name] = max(best.get(name, 0.0), rate)
    print(
        f"batch-1 decode, {args.decode_tokens} tokens after a 64-token prompt, "
        f"{args.threads} thread(s), best of {args.rounds} rounds:"
    )
    for name, rate in best.items():
        print(f"  {name:>16}: {rate:6.1f} tok/s  ({1000 / rate:.2f} ms/token)")


class Timed:
    """Wraps a callable and records each call's seconds."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.times: list[float] = []

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.times.append(time.perf_counter() - start)
        return out


def profile(args, llm: LLM) -> None:
    core = llm.core
    model = core.runner.model
    native = model.native_decode = Timed(model.native_decode)
    logits = model.compute_logits = Timed(model.compute_logits)
    step = core.step = Timed(core.step)
    seconds(llm, args.decode_tokens + 1)
    # Decode steps only: the native call ran in them (the prefill's step is the first).
    steps = step.times[-len(native.times) :]
    total, native_ms = statistics.median(steps), statistics.median(native.times)
    handed = statistics.median(logits.times[-len(native.times) :])
    print(f"native step profile (median of {len(steps)} decode steps), ms:")
    print(
        f"  whole step {1000 * total:.2f} = every layer and the head (one C++ call) "
        f"{1000 * native_ms:.2f}"
    )
    print(f"  + compute_logits (the step's logits handed back) {1000 * handed:.2f}")
    print(
        f"  + the rest (scheduler, metadata, sampling, outputs) {1000 * (total - native_ms - handed):.2f}"
    )
    # The C++ call against the memory limit: the weights it streams over its time, and a
    # STREAM-like read of 1 GiB (memory_limit.py's probe) at 1 thread and the engine's.
    weight = decode_weight_bytes(model)
    probes = {count: read_bandwidth(count, 1.0, 5) for count in sorted({1, args.threads})}
    torch.set_num_threads(args.threads)
    print(
        f"  the C++ call streams {weight / 1e6:.1f} MB of weights: "
        f"{weight / native_ms / 1e9:.1f} GB/s at its median, "
        f"{weight / min(native.times) / 1e9:.1f} at its best; read probe "
        + ", ".join(f"{count} thread(s) {rate / 1e9:.1f} GB/s" for count, rate in probes.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    llms = engines(args)
    decode_rates(args, llms)
    profile(args, llms["native int4"])
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
