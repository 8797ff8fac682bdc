"""The native decode step's C++ call (layers/llama_decode.cpp) built from two source trees, on
one captured batch-1 step of the embedded SmolLM2 (int4), called in alternation in one process.

This tree's engine decodes 100 tokens after a 64-token prompt and its last native step's
arguments are kept; the `--before` tree's llama_decode.cpp, paged_decode.cpp, quant_gemv.cpp
and kernel_parts.h are compiled with this tree's flags (decode_kernel.py) into a second
extension, and both decoders are built over the same model tensors. Each call rewrites the
same K/V slot, so every call sees the same state. Prints whether the two agree to the bit,
each one's best and median call (and the weights' GB/s at them), the median ratio, the read
probe at 1 thread and `--threads` (memory_limit.py's), and the load average. The median is
what a loaded machine moves: a call's threads meet ~150 times, each a chance to wait for a
thread off its core.

    PYTHONPATH=. .venv/bin/python benchmarks/native_step_ab.py --before /work/main
        [--threads 2] [--calls 60]
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from memory_limit import decode_weight_bytes, read_bandwidth
from torch.utils.cpp_extension import load

from deepwell.engine import LLM, SamplingParams
from deepwell.engine.layers import decode_kernel
from deepwell.engine.models.llama_native import build_native_decode

PROMPT = list(range(1000, 1064))


def before_kernel(tree: Path):
    """The before tree's whole-step decoder, compiled as this tree compiles its own."""
    layers = tree / "deepwell" / "engine" / "layers"
    capability, flags = decode_kernel._vector_flags()
    sources = [layers / path.name for path in decode_kernel.LLAMA_SOURCES]
    build = Path.home() / ".cache" / "deepwell" / f"native_step_ab_{capability.lower()}"
    build.mkdir(parents=True, exist_ok=True)
    unity = build / "unity.cpp"
    unity.write_text("".join(f'#include "{path}"\n' for path in sources))
    return load(
        f"native_step_ab_{capability.lower()}",
        [str(unity)],
        extra_cflags=[*flags, "-DDEEPWELL_ONE_EXTENSION"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
    )


def captured_step(llm: LLM) -> list:
    """The arguments of the last native call of a 100-token greedy decode."""
    native = llm.core.runner.model.native_decode
    decoder, calls = native.decoder, []

    class Recording:
        def forward(self, *args):
            calls.append([a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            return decoder.forward(*args)

    native.decoder = Recording()
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    native.decoder = decoder
    return calls[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other source tree")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=60, help="calls of each, alternating")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    llm = LLM(
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        quantization="int4",
        num_threads=args.threads,
        decode_sequence=False,
    )
    model = llm.core.runner.model
    step = captured_step(llm)
    decoders = {
        "before": build_native_decode(model, before_kernel(args.before)).decoder,
        "after": build_native_decode(model, decode_kernel.load_llama_kernel().module).decoder,
    }
    (hidden_a, logits_a), (hidden_b, logits_b) = (d.forward(*step) for d in decoders.values())
    same = torch.equal(hidden_a, hidden_b) and torch.equal(logits_a, logits_b)
    print(f"hidden state and logits equal to the bit: {same}")
    times = {name: [] for name in decoders}
    for _ in range(args.calls):
        for name, decoder in decoders.items():
            start = time.perf_counter()
            decoder.forward(*step)
            times[name].append(time.perf_counter() - start)
    weight = decode_weight_bytes(model)
    probes = {count: read_bandwidth(count, 1.0, 5) for count in sorted({1, args.threads})}
    print(
        f"{args.threads} thread(s), {weight / 1e6:.1f} MB of weights a call; read probe "
        + ", ".join(f"{count} thread(s) {rate / 1e9:.1f} GB/s" for count, rate in probes.items())
    )
    for name, seconds in times.items():
        best, median = min(seconds), statistics.median(seconds)
        print(
            f"  {name:6s} best {1e3 * best:6.2f} ms ({weight / best / 1e9:5.1f} GB/s), "
            f"median {1e3 * median:6.2f} ms ({weight / median / 1e9:5.1f} GB/s)"
        )
    ratio = statistics.median(times["before"]) / statistics.median(times["after"])
    print(f"median call, before / after: {ratio:.2f}x")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
