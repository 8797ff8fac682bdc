"""The measurements of benchmarks/gpu_check.sh, one per process: `tokens`, `w` and `decode`
each run one engine configuration and print one JSON line (the script compares and reports).

- tokens: greedy token ids of fixed prompts (token ids, valid in every vocabulary);
- w: workload W (benchmarks/workload.py) on the embedded model, deepwell or transformers
  (static batches, the best of `--hf-batch-sizes`), output tokens per second;
- decode: the decode step time at a batch size, and the share of `--peak-gbps` it streams,
  counting the weights once per step plus every KV entry of the batch's contexts (a floor
  on the bytes a step must read: activations and re-reads are left out).

    .venv/bin/python benchmarks/gpu_check.py tokens --model DIR --device cuda
    .venv/bin/python benchmarks/gpu_check.py w --engine transformers --device cuda
    .venv/bin/python benchmarks/gpu_check.py decode --batch 64 --device cuda --peak-gbps 4800
"""

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from workload import make_workload  # noqa: E402

PROMPTS = [[5, 9, 13, 21, 34, 55, 89], [7] * 12, list(range(20, 60))]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _llm(args, **kwargs):
    from deepwell.engine import LLM

    return LLM(
        args.model,
        device=args.device,
        kernels=args.kernels,
        dtype=args.dtype,
        num_speculative_tokens=0,
        enable_prefix_caching=False,
        **kwargs,
        decode_sequence=False,
    )


def run_tokens(args) -> dict:
    from deepwell.engine import SamplingParams

    llm = _llm(args, max_model_len=256, memory_gib=args.memory_gib)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return {"tokens": [o.token_ids for o in outputs]}


def _workload(args) -> list[dict]:
    requests = make_workload(requests=args.requests)
    for r in requests:
        # --scale shortens W for a CPU rehearsal; 1 is W itself.
        r["prompt_ids"] = r["prompt_ids"][: max(8, int(r["prompt_len"] * args.scale))]
        r["output_len"] = max(4, int(r["output_len"] * args.scale))
    return requests


def run_w(args) -> dict:
    requests = _workload(args)
    outputs = sum(r["output_len"] for r in requests)
    if args.engine == "deepwell":
        from deepwell.engine import SamplingParams

        llm = _llm(args, memory_gib=args.memory_gib)
        greedy = {"temperature": 0, "ignore_eos": True}
        params = [SamplingParams(max_tokens=r["output_len"], **greedy) for r in requests]
        prompts = [r["prompt_ids"] for r in requests]
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=params[:2], use_tqdm=False)
        _sync(args.device)
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        _sync(args.device)
        return {"engine": "deepwell", "output_tok_s": outputs / (time.perf_counter() - start)}
    model = _hf_model(args)
    best = None
    for batch_size in args.hf_batch_sizes:
        _hf_generate(model, [requests[0]["prompt_ids"]], 4, args.device)
        elapsed = 0.0
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            longest = max(r["output_len"] for r in batch)
            elapsed += _hf_generate(model, [r["prompt_ids"] for r in batch], longest, args.device)
        rate = outputs / elapsed
        if best is None or rate > best["output_tok_s"]:
            best = {"engine": "transformers", "batch_size": batch_size, "output_tok_s": rate}
    return best


def _hf_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepwell.engine.models.loader import load_checkpoint

    # The embedded model's own weights, dequantised and cast as deepwell does.
    dtype = getattr(torch, "bfloat16" if args.dtype == "auto" else args.dtype)
    checkpoint = load_checkpoint(None)
    model = LlamaForCausalLM(LlamaConfig(**checkpoint.hf_config)).to(dtype)
    tensors = {name: t.to(dtype) for name, t in checkpoint.tensors.items()}
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.to(args.device).eval()


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    pad = 2
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    _sync(device)
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
    _sync(device)
    return time.perf_counter() - start


def run_decode(args) -> dict:
    from deepwell.engine import SamplingParams

    context = args.prompt_len + args.tokens + 1  # the longest timed run: tokens + 1
    llm = _llm(args, max_num_seqs=args.batch, memory_gib=args.memory_gib, max_model_len=context)
    prompts = [[17 + (i * 7 + j) % 200 for j in range(args.prompt_len)] for i in range(args.batch)]

    def timed(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        _sync(args.device)
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        _sync(args.device)
        return time.perf_counter() - start

    timed(2)
    step_s = (timed(args.tokens + 1) - timed(1)) / args.tokens
    core = llm.core
    model = core.runner.model
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    layout, block_size = core.kv.layout, core.kv.block_size
    kv_per_token = layout.block_bytes(block_size, model.dtype) / block_size
    mean_context = args.prompt_len + args.tokens / 2
    step_bytes = weights + args.batch * mean_context * kv_per_token
    return {
        "batch": args.batch,
        "step_ms": step_s * 1e3,
        "tok_s": args.batch / step_s,
        "bytes_per_step": int(step_bytes),
        "bandwidth_share": step_bytes / step_s / (args.peak_gbps * 1e9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("tokens", "w", "decode"))
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernels", default="auto", choices=("auto", "triton"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--memory-gib", type=float, default=4.0, help="the CPU budget")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens: per prompt")
    parser.add_argument("--engine", default="deepwell", choices=("deepwell", "transformers"))
    parser.add_argument("--requests", type=int, default=64, help="w: W's first N requests")
    parser.add_argument("--scale", type=float, default=1.0, help="w: prompt/output share")
    parser.add_argument(
        "--hf-batch-sizes",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[16, 32, 64],
        help="w: transformers' static batch sizes to try",
    )
    parser.add_argument("--batch", type=int, default=1, help="decode: sequences")
    parser.add_argument("--prompt-len", type=int, default=64, help="decode: prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="decode: steps timed")
    parser.add_argument(
        "--peak-gbps", type=float, default=4800.0, help="decode: memory bandwidth (H200: 4800)"
    )
    args = parser.parse_args()
    run = {"tokens": run_tokens, "w": run_w, "decode": run_decode}[args.what]
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
