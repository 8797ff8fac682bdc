"""The native decode step against the torch path on one of W's decode steps, in one process:
the same model, cache and step, the two paths interleaved.

The embedded SmolLM2 takes W's first `--rows` requests (benchmarks/workload.py) until each
has its first token; the next all-decode step's forward is captured, then replayed
`--repeats` times on each path in turn (each replay stores the same K/V in the same slots),
at each of `--threads`. Prints the median wall and process CPU of the forward per path and
the torch path's over the native one's. With `--check`, also whether the two paths' hidden
states are equal to the bit.

    .venv/bin/python benchmarks/native_decode_step.py [--dtype bfloat16] [--rows 64]
"""

import argparse
import os
import statistics
import time

import torch
from workload import make_workload

from deepwell.engine import EngineArgs, EngineCore, SamplingParams


def capture_decode_step(core: EngineCore, rows: int) -> tuple:
    """W's first `rows` requests, stepped until all decode; the next step's forward arguments."""
    greedy = {"temperature": 0, "ignore_eos": True}
    workload = make_workload()[:rows]
    for request in workload:
        params = SamplingParams(max_tokens=request["output_len"], **greedy)
        core.add_request(str(request["id"]), request["prompt_ids"], params)
    started: set[str] = set()
    while len(started) < len(workload):
        started |= {out.request_id for out in core.step() if out.new_token_ids}
    model, captured = core.runner.model, []
    forward = model.forward

    def capturing(input_ids, positions, meta, kv_cache):
        captured.append((input_ids.clone(), positions.clone(), meta, kv_cache))
        return forward(input_ids, positions, meta, kv_cache)

    model.forward = capturing
    core.step()
    model.forward = forward
    (step,) = captured
    assert step[0].shape[0] == rows and model.native_decode.takes(step[0], step[2])
    return step


@torch.inference_mode()
def time_paths(model, step: tuple, native, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, process CPU) seconds of the forward per path, the paths interleaved."""
    samples: dict[str, list[tuple[float, float]]] = {"torch": [], "native": []}
    for _ in range(repeats):
        for path in samples:
            model.native_decode = native if path == "native" else None
            wall, cpu = time.perf_counter(), time.process_time()
            model(*step)
            samples[path].append((time.perf_counter() - wall, time.process_time() - cpu))
    model.native_decode = native
    return {
        path: (statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs))
        for path, runs in samples.items()
    }


@torch.inference_mode()
def equal_bits(model, step: tuple, native) -> bool:
    model.native_decode = None
    expected = model(*step)
    model.native_decode = native
    return torch.equal(model(*step), expected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    core = EngineCore(
        EngineArgs(
            dtype=args.dtype,
            enable_prefix_caching=False,
            num_speculative_tokens=0,
            async_scheduling=False,
            num_threads=max(args.threads),
        )
    )
    model = core.runner.model
    native = model.native_decode
    assert native is not None, "the model runs no native decode step (see the start-up log)"
    step = capture_decode_step(core, args.rows)
    print(
        f"{args.dtype}, {args.rows}-row decode step of W, torch {torch.__version__}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}"
    )
    if args.check:
        print(f"hidden states equal to the bit: {equal_bits(model, step, native)}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        medians = time_paths(model, step, native, args.repeats)
        (torch_wall, torch_cpu), (native_wall, native_cpu) = medians["torch"], medians["native"]
        print(
            f"{threads} thread(s): torch path {torch_wall * 1e3:.2f} ms wall, "
            f"{torch_cpu * 1e3:.2f} ms CPU; native {native_wall * 1e3:.2f} ms wall, "
            f"{native_cpu * 1e3:.2f} ms CPU; torch / native {torch_wall / native_wall:.3f}x "
            f"wall, {torch_cpu / native_cpu:.3f}x CPU "
            f"(load average {os.getloadavg()[0]:.2f})"
        )


if __name__ == "__main__":
    main()
