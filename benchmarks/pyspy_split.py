"""Split py-spy samples of the engine's step loop into linears, attention, model glue and the
engine's own phases (the split of benchmarks/step_profile.py, without a tracer's overhead).

py-spy (not a project dependency: install it in a scratch venv) samples a plain run; each
sample of a timed decode step (`EngineCore.step` under step_profile's `measure`, so not
the prefill before it) is charged to what its innermost deepwell frame runs:

    py-spy record -r 1000 --format raw -o b1.txt -- \\
        .venv/bin/python benchmarks/step_profile.py --batch 1 --steps 400 --no-trace
    .venv/bin/python benchmarks/pyspy_split.py b1.txt
"""

import argparse
from collections import Counter

LINEARS = ("packed_linear.py", "quant_linear.py", "nn/modules/linear.py")
ATTENTION = ("cpp_paged.py", "torch_paged.py", "layers/attention.py", "decode_kernel.py")
# The engine's phases, by the function a sample's stack passes through.
PHASES = (
    ("Scheduler.schedule", "engine: schedule"),
    ("ModelRunner.prepare", "engine: prepare (inputs, step metadata)"),
    ("ModelRunner.sample", "engine: sample"),
    ("StepPipeline._commit", "engine: commit (append tokens, stops, outputs)"),
)


def in_stack(frames: list[str], function: str) -> bool:
    return any(frame.startswith(function + " ") for frame in frames)


def part_of(frames: list[str]) -> str:
    leaf = [frame for frame in frames if "deepwell/" in frame][-1]
    logits = in_stack(frames, "LlamaForCausalLM.compute_logits")
    if logits or in_stack(frames, "LlamaForCausalLM.forward"):
        where = "logits" if logits else "forward"
        if any(name in leaf for name in LINEARS):
            return f"{where}: linears"
        if any(name in leaf for name in ATTENTION):
            return f"{where}: attention"
        if "norm.py" in leaf:
            return f"{where}: glue: RMSNorm"
        if "rotary.py" in leaf:
            return f"{where}: glue: rotary"
        return f"{where}: glue: other (residual adds, casts, splits, silu, embedding)"
    for function, part in PHASES:
        if in_stack(frames, function):
            return part
    return "engine: the rest of the step loop"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", help="py-spy record --format raw output")
    args = parser.parse_args()
    parts: Counter[str] = Counter()
    with open(args.raw) as lines:
        for line in lines:
            stack, count = line.rsplit(" ", 1)
            frames = stack.split(";")
            if in_stack(frames, "measure") and in_stack(frames, "EngineCore.step"):
                parts[part_of(frames)] += int(count)
    total = sum(parts.values())
    print(f"{total} samples in timed decode steps")
    for part, count in sorted(parts.items()):
        print(f"  {part:66s} {count / total:6.1%}")


if __name__ == "__main__":
    main()
