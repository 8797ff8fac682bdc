"""deepwell vs transformers `generate` on workload W, in one process, on the same bf16 weights.

Workload W (../shared/bench/workload.py): 64 requests, prompts of 64–512 random token ids,
outputs of 64–256 tokens (ignore EOS), seeded. transformers runs static left-padded batches
of 16 in W's order, each generating its longest request's length; only requested tokens
count. Also measures batch-1 decode tok/s for both. The engines run in alternating rounds
and each keeps its fastest (this 2-core box swings by ~10% over minutes, for both
engines alike). Prints `throughput ratio (deepwell/transformers): X`.

    .venv/bin/python benchmarks/throughput_vs_hf.py [--rounds 2] [--threads N] [--json out.json]
"""

import argparse
import importlib.util
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT.parent / "shared" / "bench" / "workload.py"


def load_workload() -> tuple[list[dict], str]:
    spec = importlib.util.spec_from_file_location("workload", WORKLOAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    requests = module.make_workload()
    return requests, module.workload_sha256(requests)


def deepwell_runner(
    workload: list[dict], decode_prompt: list[int], decode_tokens: int
) -> Callable[[], dict]:
    from deepwell.engine import LLM, SamplingParams

    # W's prompts share no prefix; off, so that a round does not hit the last round's blocks.
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False)
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

    def run() -> dict:
        params = [SamplingParams(max_tokens=r["output_len"], **greedy) for r in workload]
        elapsed = timed([r["prompt_ids"] for r in workload], params)
        first = timed([decode_prompt], SamplingParams(max_tokens=1, **greedy))
        full = timed([decode_prompt], SamplingParams(max_tokens=decode_tokens + 1, **greedy))
        return {"seconds": elapsed, "batch1_decode_tok_s": decode_tokens / (full - first)}

    return run


def transformers_runner(
    workload: list[dict], decode_prompt: list[int], decode_tokens: int, batch_size: int
) -> Callable[[], dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepwell.engine.models.loader import load_checkpoint

    # The GGUF dequantised once, as deepwell does, then cast to bf16: both engines run the
    # very same bf16 weights (transformers' own GGUF path keeps them quantised in float32).
    checkpoint = load_checkpoint(None)
    model = LlamaForCausalLM(LlamaConfig(**checkpoint.hf_config)).to(torch.bfloat16)
    tensors = {name: t.to(torch.bfloat16) for name, t in checkpoint.tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.eval()
    pad = 2

    def generate(prompts: list[list[int]], new_tokens: int) -> float:
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
            )
        return time.perf_counter() - start

    generate([decode_prompt], 8)

    def run() -> dict:
        elapsed = 0.0
        for i in range(0, len(workload), batch_size):
            batch = workload[i : i + batch_size]
            longest = max(r["output_len"] for r in batch)
            elapsed += generate([r["prompt_ids"] for r in batch], longest)
        first = generate([decode_prompt], 1)
        full = generate([decode_prompt], decode_tokens + 1)
        return {"seconds": elapsed, "batch1_decode_tok_s": decode_tokens / (full - first)}

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, help="torch threads for both engines (default: torch's)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="transformers' static batch size"
    )
    parser.add_argument("--decode-tokens", type=int, default=128, help="batch-1 decode length")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds; each engine keeps its fastest"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    workload, sha = load_workload()
    prompt_tokens = sum(r["prompt_len"] for r in workload)
    output_tokens = sum(r["output_len"] for r in workload)
    print(
        f"workload W: {len(workload)} requests, {prompt_tokens} prompt + {output_tokens} output tokens, sha256 {sha[:16]}…"
    )
    print(f"torch threads: {torch.get_num_threads()}")
    decode_prompt = workload[0]["prompt_ids"][:64]
    print("loading deepwell and transformers …", flush=True)
    runners = {
        "deepwell": deepwell_runner(workload, decode_prompt, args.decode_tokens),
        "transformers": transformers_runner(
            workload, decode_prompt, args.decode_tokens, args.batch_size
        ),
    }
    results: dict[str, dict] = {}
    rounds: list[dict[str, dict]] = []
    for index in range(args.rounds):
        rounds.append({})
        for name, run in runners.items():
            print(f"round {index + 1}/{args.rounds}: running {name} …", flush=True)
            result = run()
            result["output_tok_s"] = output_tokens / result["seconds"]
            rounds[-1][name] = result
            print(
                f"{name}: {result['seconds']:.1f} s, {result['output_tok_s']:.1f} output tok/s, "
                f"batch-1 decode {result['batch1_decode_tok_s']:.1f} tok/s",
                flush=True,
            )
            best = results.setdefault(name, dict(result))
            best["seconds"] = min(best["seconds"], result["seconds"])
            best["output_tok_s"] = output_tokens / best["seconds"]
            best["batch1_decode_tok_s"] = max(
                best["batch1_decode_tok_s"], result["batch1_decode_tok_s"]
            )
    for name, best in results.items():
        print(
            f"{name} (fastest of {args.rounds}): {best['seconds']:.1f} s, "
            f"{best['output_tok_s']:.1f} output tok/s, "
            f"batch-1 decode {best['batch1_decode_tok_s']:.1f} tok/s"
        )
    ratio = results["deepwell"]["output_tok_s"] / results["transformers"]["output_tok_s"]
    decode_ratio = (
        results["deepwell"]["batch1_decode_tok_s"] / results["transformers"]["batch1_decode_tok_s"]
    )
    print(f"batch-1 decode ratio (deepwell/transformers): {decode_ratio:.2f}")
    print(f"throughput ratio (deepwell/transformers): {ratio:.2f}")
    if args.json:
        summary = {
            "workload_sha256": sha,
            "threads": torch.get_num_threads(),
            "results": results,
            "rounds": rounds,
            "throughput_ratio": ratio,
            "batch1_decode_ratio": decode_ratio,
        }
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
