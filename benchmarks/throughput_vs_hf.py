"""deepwell vs transformers on workload W, each engine alone in its own process, at its best.

Workload W (benchmarks/workload.py): 64 requests, prompts of 64–512 random token ids,
outputs of 64–256 tokens (EOS ignored), seeded, all submitted at t = 0. Every measurement
runs in a fresh child process with the same torch thread count and dtype, so no engine's
threads, allocator or oneDNN caches slow the other (run in one process, transformers read
about half its own speed after deepwell's engine had started its threads).

- deepwell: `LLM.generate` over W with speculation off and on (`--k` draft tokens), for
  each of `--quantizations` (its `--quantization`: none, int4);
- transformers `generate`: static left-padded batches of each `--hf-batch-sizes` in W's
  order, each generating its longest request's length (only requested tokens count), with
  each of `--hf-caches` (its default dynamic KV cache, and its static one: preallocated,
  one shape for every step), and its continuous-batching manager (`generate_batch`'s engine, per-request lengths) unless
  `--no-hf-continuous`; its best configuration is the baseline;
- batch-1 decode tok/s of each engine: 64-token prompt, (time for n + 1 tokens − time for
  1 token) / n, the mean of `--decode-repetitions` runs;
- llama.cpp (benchmarks/llama_cpp_peer.py, the same GGUF, the same threads): its tg128 whenever a
  build is in the cache, and with `--llama-cpp` (which builds it first if needed, ~15 min)
  also W through `llama-server -np 16`. Without a build, batch-1 decode is compared against
  the tg128 issue 16 quotes (151–166 tok/s, 2 threads, another machine), and says so.

`--dtype` takes one or more compute dtypes (comma-separated); with two, every engine runs in
each and its faster one is its best, so `--force-avx2 --dtype bfloat16,float32` compares each
engine at its best with AVX2 forced: torch's, oneDNN's, MKL's and deepwell's own kernels at
AVX2 in every child (benchmarks/forced_avx2.py; each child reports the dispatch level it ran).

Rounds alternate the configurations and each keeps its fastest. Prints
`throughput ratio, speculation off (deepwell/transformers best): X` and the same for on,
`batch-1 decode ratio vs llama.cpp tg128, …`, with `--llama-cpp` the W ratio against
llama-server, and warns when the baseline reads far below transformers' known figure on
this kind of CPU (a broken baseline is not a win).

    .venv/bin/python benchmarks/throughput_vs_hf.py [--threads N] [--rounds 1]
        [--hf-batch-sizes 8,16,32,64] [--hf-caches dynamic,static] [--no-hf-continuous] [--quantizations none,int4]
        [--dtype bfloat16[,float32]] [--force-avx2] [--llama-cpp] [--llama-cpp-cache DIR] [--json out.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import llama_cpp_peer as llama_cpp
from forced_avx2 import AVX2_ENVIRONMENT
from workload import make_workload, workload_sha256

ROOT = Path(__file__).resolve().parents[1]

# transformers 5.x on W measured alone in its process, 2 threads (issue 16): bf16 on a CPU
# with AVX512_BF16, and float32 on an AVX2-only CPU. Output tok/s of its best static batch
# and batch-1 decode tok/s.
KNOWN_BASELINES = {
    ("bfloat16", True): {"output_tok_s": 156.4, "batch1_decode_tok_s": 49.3},
    ("float32", False): {"output_tok_s": 38.1, "batch1_decode_tok_s": None},
}
# Below this share of the known figure a baseline is called broken.
BASELINE_FLOOR = 0.7
LLAMA_CPP = "llama.cpp"
DTYPES = ("bfloat16", "float32")
HF_CACHES = ("dynamic", "static")


def load_workload() -> tuple[list[dict], str]:
    requests = make_workload()
    return requests, workload_sha256(requests)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86 AVX512_BF16/AMX, Arm BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16", "bf16"))


# ---- children: each runs one engine configuration and prints one JSON line ----


def child_deepwell(args, workload: list[dict], decode_prompt: list[int]) -> dict:
    from deepwell.engine import LLM, SamplingParams

    # W's prompts share no prefix; off, so that a round does not hit the last round's blocks.
    llm = LLM(
        dtype=args.dtype,
        enable_prefix_caching=False,
        num_speculative_tokens=args.k,
        quantization=args.quantization,
        decode_sequence=False,
    )
    greedy = {"temperature": 0, "ignore_eos": True}
    llm.generate(
        prompt_token_ids=[decode_prompt],
        sampling_params=SamplingParams(max_tokens=8, **greedy),
        use_tqdm=False,
    )

    def timed(prompts, params) -> float:
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - start

    params = [SamplingParams(max_tokens=r["output_len"], **greedy) for r in workload]
    elapsed = timed([r["prompt_ids"] for r in workload], params)
    decode = batch1_decode(
        args, lambda tokens: timed([decode_prompt], SamplingParams(max_tokens=tokens, **greedy))
    )
    return {"seconds": elapsed, **decode}


def batch1_decode(args, timed_tokens) -> dict:
    """Batch-1 decode tok/s, (time of n + 1 tokens - time of 1) / n, as the mean of
    `--decode-repetitions` runs (llama-bench reports its tg128 so: mean ± standard deviation)."""
    rates = []
    for _ in range(args.decode_repetitions):
        first = timed_tokens(1)
        full = timed_tokens(args.decode_tokens + 1)
        rates.append(args.decode_tokens / (full - first))
    spread = statistics.stdev(rates) if len(rates) > 1 else 0.0
    return {"batch1_decode_tok_s": statistics.fmean(rates), "batch1_decode_std": spread}


def hf_model(dtype: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepwell.engine.models.loader import load_checkpoint

    # The GGUF dequantised once, as deepwell does, then cast: both engines run the very
    # same weights (transformers' own GGUF path keeps them quantised in float32).
    torch_dtype = getattr(torch, dtype)
    checkpoint = load_checkpoint(None)
    model = LlamaForCausalLM(LlamaConfig(**checkpoint.hf_config)).to(torch_dtype)
    tensors = {name: t.to(torch_dtype) for name, t in checkpoint.tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, cache: str = "dynamic") -> float:
    import torch

    pad = 2
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            **({} if cache == "dynamic" else {"cache_implementation": cache}),
        )
    return time.perf_counter() - start


def child_hf_static(args, workload: list[dict], decode_prompt: list[int]) -> dict:
    model = hf_model(args.dtype)
    hf_generate(model, [decode_prompt], 8, args.hf_cache)
    elapsed = 0.0
    for i in range(0, len(workload), args.batch_size):
        batch = workload[i : i + args.batch_size]
        longest = max(r["output_len"] for r in batch)
        elapsed += hf_generate(model, [r["prompt_ids"] for r in batch], longest, args.hf_cache)
    decode = batch1_decode(
        args, lambda tokens: hf_generate(model, [decode_prompt], tokens, args.hf_cache)
    )
    return {"seconds": elapsed, **decode}


def child_hf_continuous(args, workload: list[dict], decode_prompt: list[int]) -> dict:
    """transformers' continuous batching (the manager behind `generate_batch`), each request
    with its own length: `generate_batch` takes one max_new_tokens for all."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = hf_model(args.dtype)
    # Sized as deepwell runs W: 1,024-token steps, all 64 requests at once, room for every
    # request's whole context (its default sizes the cache from free memory and is killed
    # for memory on a CPU box), no prefix sharing (W's prompts share none).
    longest = max(r["prompt_len"] + r["output_len"] for r in workload)
    page = 256
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=len(workload) * -(-longest // page) + 8,
        max_batch_tokens=1024,
        max_requests_per_batch=64,
        allow_block_sharing=False,
    )
    config = GenerationConfig(
        do_sample=False, eos_token_id=-1, max_new_tokens=max(r["output_len"] for r in workload)
    )

    def run(requests: list[tuple[list[int], int]]) -> float:
        with model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb_config, block=True, timeout=5
        ) as manager:
            start = time.perf_counter()
            for index, (prompt, length) in enumerate(requests):
                manager.add_request(prompt, request_id=f"r{index}", max_new_tokens=length)
            done = 0
            while done < len(requests):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers request failed: {result.error}")
                    done += 1
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop died")
            return time.perf_counter() - start

    run([(decode_prompt, 8)])
    elapsed = run([(r["prompt_ids"], r["output_len"]) for r in workload])
    return {"seconds": elapsed, "batch1_decode_tok_s": None}


def child_llama_cpp(args, workload: list[dict], decode_prompt: list[int]) -> dict:
    """llama-bench's tg128 and, with `serve_w`, W through llama-server (its own processes)."""
    llama = llama_cpp.find_llama_cpp(args.llama_cpp_cache)
    if llama is None:
        raise llama_cpp.LlamaCppError(f"no llama.cpp build in {args.llama_cpp_cache}")
    decode = llama_cpp.tg128(llama, args.threads)
    seconds = llama_cpp.serve_w(llama, args.threads, workload).seconds if args.serve_w else None
    return {
        "seconds": seconds,
        "batch1_decode_tok_s": decode.tok_s,
        "batch1_decode_std": decode.stddev_tok_s,
        "tg128": asdict(decode),
    }


CHILDREN = {
    "deepwell": child_deepwell,
    "hf-static": child_hf_static,
    "hf-continuous": child_hf_continuous,
    "llama-cpp": child_llama_cpp,
}


def child_main(args) -> None:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    (args.dtype,) = args.dtype  # the parent hands each child one
    workload = load_workload()[0][: args.requests]
    result = CHILDREN[args.child](args, workload, workload[0]["prompt_ids"][:64])
    if args.child != "llama-cpp":  # llama.cpp runs its own build's instructions
        result["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    print(json.dumps(result), flush=True)


# ---- parent: runs each configuration in a fresh process, alternating rounds ----


def run_child(args, kind: str, **extra) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--threads",
        str(args.threads),
        "--decode-tokens",
        str(args.decode_tokens),
        "--decode-repetitions",
        str(args.decode_repetitions),
        "--requests",
        str(args.requests),
        "--llama-cpp-cache",
        str(args.llama_cpp_cache),
    ]
    for name, value in extra.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    if args.force_avx2:
        env.update(AVX2_ENVIRONMENT)
    try:
        result = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"not done in {args.timeout:.0f} s"}
    if result.returncode:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr else "failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def deepwell_name(quantization: str, speculation: str, dtype: str = "") -> str:
    weights = "" if quantization == "none" else f" {quantization}"
    return f"deepwell{weights}, speculation {speculation}{dtype_suffix(dtype)}"


def dtype_suffix(dtype: str) -> str:
    """A configuration's dtype in its name, where a run tries more than one."""
    return f" ({dtype})" if dtype else ""


def configurations(args) -> dict[str, tuple[str, dict]]:
    configs = {}
    named = len(args.dtype) > 1
    for dtype in args.dtype:
        suffix = dtype_suffix(dtype if named else "")
        for quantization in args.quantizations:
            for label, k in (("off", 0), ("on", args.k)):
                extra = {"k": k, "quantization": quantization, "dtype": dtype}
                configs[deepwell_name(quantization, label, dtype if named else "")] = (
                    "deepwell",
                    extra,
                )
        for size in args.hf_batch_sizes:
            for cache in args.hf_caches:
                extra = {"batch_size": size, "dtype": dtype, "hf_cache": cache}
                cache_name = "" if cache == "dynamic" else f", {cache} cache"
                configs[f"transformers static batch {size}{cache_name}{suffix}"] = (
                    "hf-static",
                    extra,
                )
        if args.hf_continuous:
            configs[f"transformers continuous batching{suffix}"] = (
                "hf-continuous",
                {"dtype": dtype},
            )
    if args.llama_cpp or llama_cpp.find_llama_cpp(args.llama_cpp_cache) is not None:
        configs[LLAMA_CPP] = ("llama-cpp", {"serve_w": int(args.llama_cpp)})
    return configs


def fastest(best: dict[str, dict], names: list[str]) -> str | None:
    """The name among `names` (one configuration in each dtype) with the most output tok/s."""
    ran = [name for name in names if name in best]
    return max(ran, key=lambda name: best[name]["output_tok_s"]) if ran else None


def warn_if_broken(args, dtype: str, output_tok_s: float, decode_tok_s: float) -> None:
    """Loud warning when the transformers baseline reads far below its known figure."""
    known = KNOWN_BASELINES.get((dtype, native_bf16()))
    if known is None or args.threads != 2 or args.force_avx2:
        print(f"(no known transformers figure for {dtype} here at {args.threads} threads)")
        return
    measured = {"output_tok_s": output_tok_s, "batch1_decode_tok_s": decode_tok_s}
    for key, figure in known.items():
        if figure is None or not measured[key]:
            continue
        share = measured[key] / figure
        line = (
            f"transformers {key} {measured[key]:.1f} against the known {figure:.1f} ({share:.0%})"
        )
        if share < BASELINE_FLOOR:
            bar = "!" * 78
            print(f"{bar}\nWARNING: BROKEN BASELINE? {line}\n{bar}", flush=True)
        else:
            print(f"baseline check: {line}")


def compare_with_llama_cpp(setting: str, deepwell: dict, llama: dict | None) -> tuple[list, dict]:
    """Lines and summary entries for one deepwell configuration (`setting`, e.g. "speculation
    off") against llama.cpp: its tg128 and W when they ran here, else issue 16's quoted tg128."""
    decode = deepwell["batch1_decode_tok_s"]
    name = f"batch-1 decode ratio vs llama.cpp tg128, {setting} (deepwell/llama.cpp)"
    if llama is None:
        low, high = llama_cpp.QUOTED_TG128_2_THREADS
        line = (
            f"{name}: {decode / high:.2f}–{decode / low:.2f} against the {low:.0f}–{high:.0f}"
            " tok/s issue 16 quotes (2 threads, another machine): llama.cpp is not built here"
            " (--llama-cpp builds and runs it)"
        )
        return [line], {"batch1_decode_ratio_vs_quoted_llama_cpp": [decode / high, decode / low]}
    ratio = decode / llama["batch1_decode_tok_s"]
    lines, entries = [f"{name}: {ratio:.2f}"], {"batch1_decode_ratio_vs_llama_cpp": ratio}
    if llama["seconds"] is not None:
        ratio = deepwell["output_tok_s"] / llama["output_tok_s"]
        lines.append(
            f"throughput ratio vs llama-server -np 16, {setting} (deepwell/llama.cpp): {ratio:.2f}"
        )
        entries["throughput_ratio_vs_llama_server"] = ratio
    return lines, entries


def describe(name: str, result: dict) -> str:
    parts = []
    if result["seconds"] is not None:
        parts.append(f"{result['seconds']:.1f} s, {result['output_tok_s']:.1f} output tok/s")
    if result["batch1_decode_tok_s"]:
        spread = result.get("batch1_decode_std")
        plus_minus = f" ± {spread:.1f}" if spread else ""
        parts.append(f"batch-1 decode {result['batch1_decode_tok_s']:.1f}{plus_minus} tok/s")
    if "cpu_capability" in result:
        parts.append(f"torch's CPU dispatch {result['cpu_capability']}")
    return f"  {name}: {', '.join(parts)}"


def cache_list(text: str) -> list[str]:
    caches = text.split(",")
    unknown = set(caches) - set(HF_CACHES)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown cache(s) {sorted(unknown)}: pick from {HF_CACHES}"
        )
    return caches


def dtype_list(text: str) -> list[str]:
    dtypes = text.split(",")
    unknown = set(dtypes) - set(DTYPES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown dtype(s) {sorted(unknown)}: pick from {DTYPES}")
    return dtypes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads for every engine"
    )
    parser.add_argument(
        "--dtype",
        type=dtype_list,
        default=["bfloat16"],
        help="compute dtypes, comma-separated (bfloat16, float32); each engine's fastest counts",
    )
    parser.add_argument(
        "--force-avx2",
        action="store_true",
        help="run every engine with torch, oneDNN, MKL and deepwell's kernels at AVX2 "
        "(benchmarks/forced_avx2.py)",
    )
    parser.add_argument("--k", type=int, default=5, help="deepwell's draft tokens when on")
    parser.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    parser.add_argument(
        "--quantizations",
        type=lambda text: text.split(","),
        default=["none"],
        help="deepwell's --quantization values to run, comma-separated (e.g. none,int4)",
    )
    parser.add_argument(
        "--hf-batch-sizes",
        type=lambda text: [int(s) for s in text.split(",")],
        default=[8, 16, 32, 64],
        help="transformers' static batch sizes to try (comma-separated)",
    )
    parser.add_argument(
        "--hf-caches",
        type=cache_list,
        default=list(HF_CACHES),
        help="transformers' KV caches to try with each static batch (comma-separated: dynamic,"
        " its default; static, preallocated at the batch's whole length)",
    )
    parser.add_argument("--hf-cache", default="dynamic", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-hf-continuous",
        dest="hf_continuous",
        action="store_false",
        help="skip transformers' continuous batching",
    )
    parser.add_argument("--decode-tokens", type=int, default=128, help="batch-1 decode length")
    parser.add_argument(
        "--decode-repetitions",
        type=int,
        default=3,
        help="batch-1 decode runs per engine, averaged (llama-bench's tg128 averages 5)",
    )
    parser.add_argument(
        "--requests", type=int, default=64, help="W's first N requests only (quick checks)"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="alternating rounds; each keeps its fastest"
    )
    parser.add_argument(
        "--timeout", type=float, default=1200.0, help="seconds one configuration may take"
    )
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="build llama.cpp if needed (~15 min) and run W through llama-server too",
    )
    parser.add_argument(
        "--llama-cpp-cache",
        type=Path,
        default=llama_cpp.CACHE_DIR,
        help="where llama.cpp is built (benchmarks/llama_cpp_peer.py)",
    )
    parser.add_argument("--serve-w", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return

    workload, sha = load_workload()
    workload = workload[: args.requests]
    output_tokens = sum(r["output_len"] for r in workload)
    print(
        f"workload W: {len(workload)} requests, {sum(r['prompt_len'] for r in workload)} prompt"
        f" + {output_tokens} output tokens, sha256 {sha[:16]}…; {args.threads} torch threads,"
        f" {','.join(args.dtype)}, native bf16: {native_bf16()},"
        f"{' AVX2 forced,' if args.force_avx2 else ''} deepwell k={args.k};"
        f" load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    if args.llama_cpp:
        try:
            llama_cpp.ensure_llama_cpp(args.llama_cpp_cache)
        except llama_cpp.LlamaCppError as error:
            sys.exit(str(error))
    elif llama_cpp.find_llama_cpp(args.llama_cpp_cache) is None:
        print(
            f"llama.cpp: no build in {args.llama_cpp_cache} (--llama-cpp builds it);"
            " batch-1 decode is compared against issue 16's quoted tg128",
            flush=True,
        )
    best: dict[str, dict] = {}
    rounds: list[dict[str, dict]] = []
    for index in range(args.rounds):
        rounds.append({})
        for name, (kind, extra) in configurations(args).items():
            print(f"round {index + 1}/{args.rounds}: {name} …", flush=True)
            result = run_child(args, kind, **extra)
            rounds[-1][name] = result
            if "error" in result:
                print(f"  {name}: failed: {result['error']}", flush=True)
                continue
            if result["seconds"] is not None:
                result["output_tok_s"] = output_tokens / result["seconds"]
            load = os.getloadavg()[0]
            print(f"{describe(name, result)} (load average {load:.2f})", flush=True)
            kept = best.setdefault(name, dict(result))
            if result["seconds"] is not None:
                kept["seconds"] = min(kept["seconds"], result["seconds"])
                kept["output_tok_s"] = output_tokens / kept["seconds"]
            decode = result["batch1_decode_tok_s"]
            if decode and decode > kept["batch1_decode_tok_s"]:
                kept["batch1_decode_tok_s"] = decode
                kept["batch1_decode_std"] = result.get("batch1_decode_std")
    print(f"fastest of {args.rounds} round(s):")
    for name, result in best.items():
        print(describe(name, result))
    peers = {name: r for name, r in best.items() if name.startswith("transformers")}
    if not peers:
        sys.exit("no transformers configuration ran: no baseline to compare against")
    hf_name = max(peers, key=lambda name: peers[name]["output_tok_s"])
    hf_decode = max(r["batch1_decode_tok_s"] or 0.0 for r in peers.values())
    print(f"transformers best: {hf_name}, {peers[hf_name]['output_tok_s']:.1f} output tok/s")
    hf_dtype = configurations(args)[hf_name][1]["dtype"]
    warn_if_broken(args, hf_dtype, peers[hf_name]["output_tok_s"], hf_decode)
    summary = {
        "workload_sha256": sha,
        "threads": args.threads,
        "dtype": args.dtype,
        "force_avx2": args.force_avx2,
        "native_bf16": native_bf16(),
        "results": best,
        "rounds": rounds,
        "transformers_best": hf_name,
    }
    for quantization in args.quantizations:
        for label in ("off", "on"):
            named = len(args.dtype) > 1
            name = fastest(
                best, [deepwell_name(quantization, label, d if named else "") for d in args.dtype]
            )
            if name is None:
                continue
            weights = "" if quantization == "none" else f", {quantization}"
            key = f"spec_{label}" + ("" if quantization == "none" else f"_{quantization}")
            ratio = best[name]["output_tok_s"] / peers[hf_name]["output_tok_s"]
            decode = best[name]["batch1_decode_tok_s"]
            summary[f"throughput_ratio_{key}"] = ratio
            summary[f"batch1_decode_ratio_{key}"] = decode / hf_decode if hf_decode else None
            print(
                f"throughput ratio, speculation {label}{weights} "
                f"(deepwell/transformers best, {name} / {hf_name}): {ratio:.2f}"
            )
            if hf_decode:
                print(
                    f"batch-1 decode ratio, speculation {label}{weights} "
                    f"(deepwell/transformers): {decode / hf_decode:.2f}"
                )
            lines, entries = compare_with_llama_cpp(
                f"speculation {label}{weights}", best[name], best.get(LLAMA_CPP)
            )
            print("\n".join(lines))
            summary.update({f"{entry}_{key}": value for entry, value in entries.items()})
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
