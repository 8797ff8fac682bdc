"""The measurements of benchmarks/gpu_check.sh, one per process: `tokens`, `w` and `decode`
each run one engine configuration and print one JSON line (the script compares and reports).

- tokens: greedy token ids of fixed prompts (token ids, valid in every vocabulary);
- w: workload W (benchmarks/workload.py) on the embedded model, deepwell or transformers
  (static batches, the best of `--hf-batch-sizes`), output tokens per second;
- decode: the decode step time at a batch size, and the share of `--peak-gbps` it streams,
  counting the weights once per step plus every KV entry of the batch's contexts (a floor
  on the bytes a step must read: activations and re-reads are left out);
- graphs: a padded decode step captured as a CUDA graph and replayed against the eager
  forward (hidden states and step time), and the engine's greedy tokens with decode graphs
  against --enforce-eager (engine/decode_graphs.py).

    .venv/bin/python benchmarks/gpu_check.py tokens --model DIR --device cuda
    .venv/bin/python benchmarks/gpu_check.py w --engine transformers --device cuda
    .venv/bin/python benchmarks/gpu_check.py decode --batch 64 --device cuda --peak-gbps 4800
    .venv/bin/python benchmarks/gpu_check.py graphs --batch 5 --device cuda
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


def run_graphs(args) -> dict:
    """One padded decode step of `--batch` sequences run eagerly, then through its graph key
    three times (seen, captured, replayed: CUDA graphs on cuda, the eager replay elsewhere),
    hidden states compared and step times; then greedy tokens with the engine's graphs
    against --enforce-eager, and how often the engine captured and replayed."""
    from deepwell.engine import SamplingParams
    from deepwell.engine.decode_graphs import (
        CudaGraphReplay,
        DecodeGraphs,
        EagerReplay,
        capture_sizes,
    )

    prompts = [[17 + (i * 7 + j) % 200 for j in range(24)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    settings = dict(max_num_seqs=args.batch, max_model_len=256, memory_gib=args.memory_gib)
    llm = _llm(args, async_scheduling=False, enforce_eager=True, **settings)
    core, runner = llm.core, llm.core.runner
    for index, prompt in enumerate(prompts):
        core.add_request(str(index), prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    core.step()  # the prefills; the next step decodes every sequence
    replay = CudaGraphReplay() if args.device.startswith("cuda") else EagerReplay()
    # Sizes past the batch: the step is padded, as most engine steps are.
    width = -(-settings["max_model_len"] // runner.block_size)
    runner.decode_graphs = DecodeGraphs(capture_sizes(args.batch + 3), replay, width)
    step = runner.prepare(core.scheduler.schedule().chunks)
    inputs = (step.input_ids, step.positions, step.meta)
    # Fixed-size decode metadata where the model has it (its key is batch size and model).
    fixed = step.meta.fixed_size

    def run_graph() -> torch.Tensor:
        return runner.decode_graphs.run(
            step.graph_size, runner.model_kind, inputs, runner._forward_model, fixed
        )

    with torch.inference_mode():
        eager = runner._forward_model(*inputs).clone()
        graphed = [run_graph().clone() for _ in range(3)]

        def timed(run) -> float:
            _sync(args.device)
            start = time.perf_counter()
            for _ in range(args.tokens):
                run()
            _sync(args.device)
            return (time.perf_counter() - start) / args.tokens * 1e3

        eager_ms = timed(lambda: runner._forward_model(*inputs))
        graph_ms = timed(run_graph)
    differences = [(g.float() - eager.float()).abs().max().item() for g in graphed]
    greedy = {}
    for enforce_eager in (True, False):
        llm = _llm(args, enforce_eager=enforce_eager, **settings)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        greedy[enforce_eager] = [o.token_ids for o in outputs]
        engine_replay = (
            None if llm.core.runner.decode_graphs is None else llm.core.runner.decode_graphs.replay
        )
    return {
        "batch": args.batch,
        "graph_size": step.graph_size,
        "fixed_size_metadata": fixed,
        "max_abs_diff_seen_captured_replayed": differences,
        "eager_step_ms": eager_ms,
        "graph_step_ms": graph_ms,
        "engine_tokens_match_enforce_eager": greedy[True] == greedy[False],
        "engine_captures": getattr(engine_replay, "captures", None),
        "engine_replays": getattr(engine_replay, "replays", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("tokens", "w", "decode", "graphs"))
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
    run = {"tokens": run_tokens, "w": run_w, "decode": run_decode, "graphs": run_graphs}[args.what]
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
