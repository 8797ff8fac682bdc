"""Prefill attention of one chunk (prefill_attention.cpp) on W-like shapes: the kernel's
forms of the bf16 products, VDPBF16PS, FMAs on the widened halves and, where they run, AMX
tiles, in the same process.

SmolLM2-135M's heads (9 query heads over 3 KV heads of 64 dims) on 128-token cache blocks;
a chunk of `length` prompt tokens ending a context of `context` keys, for W's prompts of
64-512 tokens. The forms run interleaved, `--repeats` times each on the same inputs, and
their medians of thread CPU time (which a busy machine inflates less than wall time) are
compared; the two vector forms' outputs must be equal bit for bit, the tiles' (which round
their sums their own way) are compared by their largest difference from the FMA form's.
Prints ns a (query head, visible key) pair, the ratios FMA / VDPBF16PS and AMX / FMA, and
the load average. `--shapes w` runs W's own chunks instead,
one layer's 84 calls as one unit (what W's mixed steps ask of each of its 30 layers).

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_chunk_attention.py [--repeats 40]
        [--threads 1] [--shapes 64:64,128:128,256:256,512:512,128:512 | w]
"""

import argparse
import os
import statistics
import time

import torch

from deepwell.engine.layers.decode_kernel import load_prefill_kernel

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 128
VECTOR_FORMS = ("dpbf16", "fma")
# W's chunk attention calls in one layer, length:context[xcount], recorded from
# benchmarks/w_split.py --threads 1 at cc758ef (2,520 calls over 30 layers, 2.38 s).
W_CHUNKS = (
    "7:7,10:358,11:386,14:139,17:17,28:326,37:37,49:49,64:64,66:66x2,69:69x2,70:70,75:75,"
    "77:77x2,80:80,85:367,90:90,95:216,99:99,102:395,111:111,112:112,121:121,121:312,124:124,"
    "125:125,134:307,136:136,139:250,140:140,145:145,153:153,157:234,159:455,173:173,189:397,"
    "191:191x2,198:198,208:208,223:223,227:227,238:238,240:240,260:260,263:263,273:372,282:282,"
    "286:335,293:293,296:296,298:298,299:299,300:307,304:384,308:308,319:319,329:329,339:356,"
    "341:341,342:342,348:348,360:360,375:375,384:384,390:390x2,409:409x2,410:410,425:425,"
    "440:440,456:456,459:496,470:470,471:471x2,482:482,489:489,497:497,506:506"
)
W_LAYERS = 30


def chunk_inputs(length: int, context: int, seed: int):
    """q (a view into a fused q/k/v projection, as the model hands it over), the caches on
    shuffled blocks with spare ones around, and the block table."""
    gen = torch.Generator().manual_seed(seed)
    used = -(-context // BLOCK_SIZE)
    shape = (used + 4, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    keys = torch.randn(shape, generator=gen).bfloat16()
    values = torch.randn(shape, generator=gen).bfloat16()
    table = torch.randperm(used + 4, generator=gen)[:used]
    q = torch.randn(length, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    return q[:, :HEADS], keys, values, table


def w_chunks() -> list[tuple[int, int]]:
    """W_CHUNKS as (length, context) calls, repeats spelled out."""
    calls = []
    for entry in W_CHUNKS.split(","):
        shape, _, count = entry.partition("x")
        length, context = (int(n) for n in shape.split(":"))
        calls += [(length, context)] * int(count or 1)
    return calls


def case(length: int, context: int, seed: int, forms: tuple[str, ...]) -> tuple:
    """One call's inputs and an output per form."""
    q, keys, values, table = chunk_inputs(length, context, seed)
    outs = {form: torch.empty(length, HEADS, HEAD_DIM, dtype=torch.bfloat16) for form in forms}
    return q, keys, values, table, context, outs


def time_forms(kernel, cases: list[tuple], repeats: int) -> tuple[dict[str, float], str]:
    """The forms over `cases` (as one unit), interleaved `repeats` times: each form's median
    thread CPU seconds, and how their outputs compare."""
    forms = tuple(cases[0][-1])
    cpu: dict[str, list[float]] = {form: [] for form in forms}
    for _ in range(repeats):
        for form in forms:
            started = time.thread_time()
            for q, keys, values, table, context, outs in cases:
                kernel.chunk_attention(
                    q, keys, values, table, context, HEAD_DIM**-0.5, outs[form], form
                )
            cpu[form].append(time.thread_time() - started)
    same = all(
        torch.equal(outs["dpbf16"].view(torch.int16), outs["fma"].view(torch.int16))
        for *_, outs in cases
    )
    verdict = "vector bits " + ("equal" if same else "DIFFER")
    if "amx" in forms:
        largest = max(
            (outs["amx"].float() - outs["fma"].float()).abs().max().item() for *_, outs in cases
        )
        verdict += f", amx within {largest:.2g} of fma"
    return {form: statistics.median(times) for form, times in cpu.items()}, verdict


def comparison(median: dict[str, float], verdict: str) -> str:
    ratios = f"; fma / dpbf16 {median['fma'] / median['dpbf16']:.3f}x"
    if "amx" in median:
        ratios += f", amx / fma {median['amx'] / median['fma']:.3f}x"
    return f"{ratios}; {verdict}; load {os.getloadavg()[0]:.2f}"


def time_w(kernel, forms: tuple[str, ...], repeats: int) -> None:
    """W's chunks of one layer per repeat, the forms interleaved; W's seconds are 30 layers'
    worth."""
    calls = enumerate(w_chunks())
    cases = [case(length, context, seed, forms) for seed, (length, context) in calls]
    median, verdict = time_forms(kernel, cases, repeats)
    print(
        f"  W's {len(cases)} chunks of a layer: "
        + ", ".join(
            f"{form} {median[form] * 1e3:.2f} ms ({median[form] * W_LAYERS:.3f} s for W)"
            for form in forms
        )
        + comparison(median, verdict)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--shapes",
        default="64:64,128:128,256:256,512:512,128:512",
        help="length:context pairs, comma-separated, or w for W's chunks",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = load_prefill_kernel()
    if kernel.module is None or not kernel.module.vectorised():
        raise SystemExit(f"prefill attention kernel unavailable here: {kernel.reason}")
    forms = VECTOR_FORMS + (("amx",) if kernel.module.on_tiles() else ())
    print(
        f"chunk attention, {HEADS} heads over {KV_HEADS} KV heads of {HEAD_DIM}, "
        f"{args.threads} thread(s), {args.repeats} interleaved repeats; thread CPU medians"
    )
    if args.shapes == "w":
        time_w(kernel.module, forms, args.repeats)
        return
    for seed, shape in enumerate(args.shapes.split(",")):
        length, context = (int(n) for n in shape.split(":"))
        cases = [case(length, context, seed, forms)]
        median, verdict = time_forms(kernel.module, cases, args.repeats)
        visible = HEADS * (length * (context - length) + length * (length + 1) // 2)
        print(
            f"  {length:4d} tokens after {context - length:4d}: "
            + ", ".join(
                f"{form} {median[form] * 1e3:.3f} ms ({median[form] * 1e9 / visible:.2f} ns)"
                for form in forms
            )
            + comparison(median, verdict)
        )


if __name__ == "__main__":
    main()
