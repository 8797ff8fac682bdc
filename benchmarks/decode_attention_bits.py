"""The decode attention kernel's outputs on many random shapes, saved by one tree and compared
bit for bit by another: a change to paged_decode.cpp that must keep the bits is run first on
main (`--save`), then on the branch (`--compare`), each under the same torch level (e.g. both
with `ATEN_CPU_CAPABILITY=avx2`, whose kernel builds take the AVX2 loops).

Cases: 1–256 rows with contexts up to 20, 130, 600 or 2,000 keys (partial last blocks),
block sizes 5–128, GQA groups 1–8 over 1–4 KV heads, head dims 16–128 (whole 16s and not),
float32 and bf16 caches, q a view past the fused projection's k heads, and the rows cut into
up to six sequences at random (a sequence's rows are read block by block together).

    PYTHONPATH=. .venv/bin/python benchmarks/decode_attention_bits.py --save main.pt
    PYTHONPATH=. .venv/bin/python benchmarks/decode_attention_bits.py --compare main.pt
"""

import argparse
import random

import torch

from deepwell.engine.layers.decode_kernel import load_decode_kernel

GROUPS = [(9, 3), (9, 3), (8, 1), (16, 2), (4, 4), (24, 3), (6, 2), (12, 3)]
HEAD_DIMS = [64, 64, 64, 128, 32, 48, 16, 80]
BLOCK_SIZES = [128, 128, 16, 8, 5, 32]
ROWS = [1, 1, 2, 3, 7, 16, 64, 130, 256]
CONTEXTS = [2000, 600, 130, 20]


def case_outputs(cases: int) -> list[tuple[str, torch.Tensor]]:
    """(description, the kernel's output) for each random case, the same cases every run."""
    kernel = load_decode_kernel().module
    assert kernel is not None, "the decode kernel did not build"
    rng = random.Random(0)
    outputs = []
    for case in range(cases):
        rows, block = rng.choice(ROWS), rng.choice(BLOCK_SIZES)
        (heads, kv_heads), dim = rng.choice(GROUPS), rng.choice(HEAD_DIMS)
        dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])
        lens = [rng.randint(1, rng.choice(CONTEXTS)) for _ in range(rows)]
        counts = [-(-n // block) for n in lens]
        num_blocks = sum(counts) + 3
        free = list(range(num_blocks))
        rng.shuffle(free)
        ids = [free.pop() for count in counts for _ in range(count)]
        starts = [0]
        for count in counts:
            starts.append(starts[-1] + count)
        cuts = sorted(rng.sample(range(1, rows), min(rows - 1, rng.randint(0, 5))))
        gen = torch.Generator().manual_seed(case)
        shape = (num_blocks, kv_heads, block, dim)
        keys = torch.randn(shape, generator=gen).to(dtype)
        values = torch.randn(shape, generator=gen).to(dtype)
        q = torch.randn(rows, heads + kv_heads, dim, generator=gen).to(dtype)[:, :heads]
        out = kernel.paged_decode(
            q,
            keys,
            values,
            torch.tensor(ids),
            torch.tensor(starts),
            torch.tensor(lens),
            torch.tensor([0, *cuts, rows]),
            dim**-0.5,
            False,
        )
        described = f"{rows} rows, block {block}, {heads}/{kv_heads} heads, dim {dim}, {dtype}"
        outputs.append((described, out))
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--save", help="write this tree's outputs here")
    which.add_argument("--compare", help="compare this tree's outputs with the ones saved here")
    parser.add_argument("--cases", type=int, default=120)
    args = parser.parse_args()
    outputs = case_outputs(args.cases)
    print(f"torch at {torch.backends.cpu.get_cpu_capability()}, {len(outputs)} cases")
    if args.save:
        torch.save([out for _, out in outputs], args.save)
        return
    saved = torch.load(args.compare)
    unequal = [
        f"{described}: max |diff| {(out.float() - before.float()).abs().max().item():.2e}"
        for (described, out), before in zip(outputs, saved, strict=True)
        if not torch.equal(out, before)
    ]
    print(f"{len(outputs) - len(unequal)} of {len(outputs)} torch.equal")
    for line in unequal:
        print("  unequal:", line)


if __name__ == "__main__":
    main()
