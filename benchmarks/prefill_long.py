"""Prefill of one long prompt (512, 4k, 16k tokens): deepwell, llama.cpp and transformers.

At each length deepwell runs against transformers (one forward, SDPA) and, with
`--quantization int4` as the other llama.cpp rows run, against llama.cpp (`llama-bench -p N
-n 0`), each in its own process.

All three run the embedded SmolLM2-135M's weights: llama.cpp its Q4_1 GGUF as it is;
deepwell and transformers the same GGUF dequantised (as deepwell loads it), written once
into a config.json + safetensors directory whose `max_position_embeddings` is raised to
cover the longest prompt. The GGUF says 8,192 positions; a 16k prompt then runs past the
trained context with the same RoPE (no scaling): the arithmetic, which is all a throughput
figure measures, is that of any 16k prompt. llama.cpp runs 16k on the same GGUF with only a
warning (its context is the prompt's length). Prompts are random token ids, seeded, a new
one per repetition, and no engine keeps a prefix between them.

- deepwell: `LLM.generate` of one token for the prompt, chunked prefill with
  `--chunk-tokens` per step (each chunk one engine step), prefix caching off; the figure is
  prompt tokens over the call's wall time (its time to the first token); "deepwell-int4" the
  same with `--quantization int4` (quantised at load; a prompt's linears run the dense
  weights either way), the figure set against llama.cpp's;
- transformers: one `model(input_ids, logits_to_keep=1)` forward in `--dtype`, SDPA;
- llama.cpp: llama-bench's pp<N> (its own mean over `--repetitions`) at its defaults (the
  weights repacked: on an AMX CPU its AMX tile kernels), where a build is in its cache
  (benchmarks/llama_cpp_peer.py; `--llama-cpp` builds it first, ~15 min).

Every (length, engine) pair is a fresh process, engines alternating within a length and
rounds alternating over all; each keeps its fastest repetition. Prints tok/s, deepwell's
ratio against each peer, the CPU's SIMD flags and the load average beside each figure.

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_long.py [--lengths 512,4096,16384]
        [--threads 2] [--rounds 1] [--repetitions 2] [--chunk-tokens 2048] [--quick]
        [--json out.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp_peer as llama_cpp

ROOT = Path(__file__).resolve().parents[1]
DEEPWELL, TRANSFORMERS, LLAMA_CPP = "deepwell", "transformers", "llama.cpp"
DEEPWELL_INT4 = "deepwell-int4"
# Each peer against the deepwell run that matches it: transformers computes in the dtype,
# llama.cpp reads Q4_1 weights.
PAIRINGS = {TRANSFORMERS: DEEPWELL, LLAMA_CPP: DEEPWELL_INT4}
# --quick: a smoke run of the whole path (the figures mean nothing).
QUICK_LENGTHS = [512, 1024]
# Positions past the longest prompt: the one sampled token and a round block count.
POSITION_HEADROOM = 256
# Random prompt ids stay clear of SmolLM2's 17 special tokens.
FIRST_PLAIN_ID = 17


def write_long_context_model(directory: Path, positions: int) -> Path:
    """The embedded GGUF dequantised into `directory` (config.json + model.safetensors, float32
    as the GGUF dequantises) with `positions` positions; returns the directory."""
    from safetensors.torch import save_file

    from deepwell.engine.models.loader import load_checkpoint

    checkpoint = load_checkpoint(None)
    config = dict(checkpoint.hf_config)
    config.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        max_position_embeddings=positions,
        torch_dtype="float32",
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {name: tensor.contiguous() for name, tensor in checkpoint.tensors.items()}
    save_file(tensors, directory / "model.safetensors")
    return directory


def random_prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PLAIN_ID, vocab_size, (length,), generator=generator).tolist()


def vocab_size(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


# ---- children: each runs one engine at one length and prints one JSON line ----


def child_deepwell(args, quantization: str = "none") -> dict:
    from deepwell.engine import LLM, SamplingParams

    llm = LLM(
        str(args.model_dir),
        dtype=args.dtype,
        quantization=quantization,
        max_model_len=args.length + POSITION_HEADROOM,
        chunked_prefill=True,
        max_num_batched_tokens=args.chunk_tokens,
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        memory_gib=args.memory_gib,
        decode_sequence=False,
    )
    vocab = vocab_size(args.model_dir)
    one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def timed(prompt: list[int]) -> float:
        start = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=one_token, use_tqdm=False)
        return time.perf_counter() - start

    # One short prompt first: the kernels load and oneDNN builds its first primitives.
    timed(random_prompt(min(args.length, 256), seed=-1 & 0xFFFF, vocab_size=vocab))
    seconds = [timed(random_prompt(args.length, rep, vocab)) for rep in range(args.repetitions)]
    return {"seconds": seconds}


def child_transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    ).eval()
    vocab = vocab_size(args.model_dir)

    def timed(prompt: list[int]) -> float:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        # logits_to_keep=1: the last row's logits only, as a prefill needs (16k rows of
        # 49,152 float32 logits would be 3.2 GB and most of the time).
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - start

    timed(random_prompt(min(args.length, 256), seed=-1 & 0xFFFF, vocab_size=vocab))
    seconds = [timed(random_prompt(args.length, rep, vocab)) for rep in range(args.repetitions)]
    return {"seconds": seconds}


def child_llama_cpp(args) -> dict:
    llama = llama_cpp.find_llama_cpp(args.llama_cpp_cache)
    (result,) = llama_cpp.llama_bench(
        llama, args.threads, n_prompt=args.length, n_gen=0, repetitions=args.repetitions
    )
    return {"tok_s": result.tok_s, "samples_tok_s": list(result.samples_tok_s)}


def child_deepwell_int4(args) -> dict:
    return child_deepwell(args, quantization="int4")


CHILDREN = {
    DEEPWELL: child_deepwell,
    DEEPWELL_INT4: child_deepwell_int4,
    TRANSFORMERS: child_transformers,
    LLAMA_CPP: child_llama_cpp,
}


def child_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    result = CHILDREN[args.child](args)
    if "seconds" in result:
        result["tok_s"] = args.length / min(result["seconds"])
    print(json.dumps(result), flush=True)


# ---- parent: every (length, engine) in a fresh process, alternating ----


def run_child(args, engine: str, length: int, model_dir: Path) -> dict:
    command = [
        sys.executable,
        __file__,
        *("--child", engine, "--length", str(length), "--model-dir", str(model_dir)),
        *("--threads", str(args.threads), "--dtype", args.dtype),
        *("--repetitions", str(args.repetitions), "--chunk-tokens", str(args.chunk_tokens)),
        *("--memory-gib", str(args.memory_gib), "--llama-cpp-cache", str(args.llama_cpp_cache)),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    load = os.getloadavg()[0]
    try:
        result = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"not done in {args.timeout:.0f} s", "load_average": load}
    if result.returncode:
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"
        return {"error": last, "load_average": load}
    return json.loads(result.stdout.strip().splitlines()[-1]) | {"load_average": load}


def engines(args) -> list[str]:
    found = llama_cpp.find_llama_cpp(args.llama_cpp_cache)
    if found is None and args.llama_cpp:
        llama_cpp.ensure_llama_cpp(args.llama_cpp_cache)
        found = llama_cpp.find_llama_cpp(args.llama_cpp_cache)
    if found is None:
        print(
            f"llama.cpp skipped: {llama_cpp.missing_build(args.llama_cpp_cache)} or pass --llama-cpp"
        )
    else:
        print(f"{llama_cpp.describe(found)}: llama-bench at its defaults (weights repacked)")
    return [DEEPWELL, TRANSFORMERS] + ([DEEPWELL_INT4, LLAMA_CPP] if found is not None else [])


def report(lengths: list[int], names: list[str], best: dict) -> dict:
    """Prints each length's tok/s and deepwell's ratio against each peer (PAIRINGS);
    returns them."""
    summary: dict = {}
    for length in lengths:
        figures = {name: best.get((length, name)) for name in names}
        row = {name: figure["tok_s"] if figure else None for name, figure in figures.items()}
        loads = {name: round(f["load_average"], 1) for name, f in figures.items() if f}
        parts = [f"{name} {tok_s:,.1f}" for name, tok_s in row.items() if tok_s]
        parts += [f"{name} failed" for name, tok_s in row.items() if not tok_s]
        print(f"prefill {length:>6} tokens: {', '.join(parts)} tok/s (load {loads})")
        ratios = {}
        for peer, own in PAIRINGS.items():
            if row.get(own) and row.get(peer):
                ratios[peer] = row[own] / row[peer]
                print(f"  ratio {own} / {peer}: {ratios[peer]:.2f}")
        summary[str(length)] = {"tok_s": row, "ratios": ratios, "load_average": loads}
    ahead = {}
    for peer in (TRANSFORMERS, LLAMA_CPP):
        ratios = [entry["ratios"].get(peer) for entry in summary.values()]
        measured = peer in names and all(ratios)
        ahead[peer] = all(ratio > 1 for ratio in ratios) if measured else None
        verdict = {True: "yes", False: "no", None: "not measured at every length"}[ahead[peer]]
        print(f"deepwell ahead of {peer} at every length: {verdict}")
    summary["ahead_at_every_length"] = ahead
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--lengths",
        type=lambda text: [int(s) for s in text.split(",")],
        default=[512, 4096, 16384],
        help="prompt lengths in tokens (comma-separated)",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="threads for every engine"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--repetitions", type=int, default=2, help="timed prompts per process (fastest kept)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds (fastest kept)")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=2048,
        help="deepwell's --max-num-batched-tokens: the prompt tokens of one prefill step",
    )
    parser.add_argument(
        "--memory-gib", type=float, default=1.5, help="deepwell's weights + KV cache budget"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds one process may take"
    )
    parser.add_argument(
        "--llama-cpp", action="store_true", help="build llama.cpp first when absent (~15 min)"
    )
    parser.add_argument(
        "--llama-cpp-cache",
        type=Path,
        default=llama_cpp.CACHE_DIR,
        help="where llama.cpp is built (benchmarks/llama_cpp_peer.py)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: lengths {','.join(map(str, QUICK_LENGTHS))}, one repetition",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repetitions = QUICK_LENGTHS, 1
    if args.child:
        child_main(args)
        return
    names = engines(args)
    flags = llama_cpp.simd_flags()
    print(f"threads {args.threads}, {args.dtype}; SIMD flags: {' '.join(flags)}", flush=True)
    best: dict = {}
    with tempfile.TemporaryDirectory(prefix="deepwell-prefill-long-") as scratch:
        positions = max(args.lengths) + POSITION_HEADROOM
        print(f"writing the embedded model with {positions} positions into {scratch}", flush=True)
        model_dir = write_long_context_model(Path(scratch), positions)
        for round_index in range(args.rounds):
            for length in args.lengths:
                # Alternate who goes first, so no engine always runs on a cooler machine.
                order = names if round_index % 2 == 0 else names[::-1]
                for name in order:
                    result = run_child(args, name, length, model_dir)
                    shown = result.get("error") or f"{result['tok_s']:,.1f} tok/s"
                    print(
                        f"round {round_index + 1}, {length} tokens, {name}: {shown}"
                        f" (load average {result['load_average']:.2f})",
                        flush=True,
                    )
                    kept = best.get((length, name))
                    if "tok_s" in result and (kept is None or result["tok_s"] > kept["tok_s"]):
                        best[(length, name)] = result
    summary = report(args.lengths, names, best)
    summary["simd_flags"] = flags
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
