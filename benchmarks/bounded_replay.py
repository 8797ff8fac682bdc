"""SWA bounded replay on DeepSeek-V4.1: prefill work it saves, and how far it drifts.

On a random tiny (or small) V4.1 checkpoint in float32 with cache quantisation off (so the
only difference between modes is the approximation):

1. Prefill FLOPs (matmuls counted by torch's FlopCounterMode over the forward of every
   step until the first token), as a ratio to the exact prefill of the whole prompt: for a
   cold prompt, and for a prompt whose shared prefix another request left in the cache
   (the hit stops at the replay start in mask/compact mode; exact mode hits at the last
   snapshot).
2. Drift of mask and compact against off, over N prompts longer than the keep: max and
   mean absolute difference of the first sampled position's logits, and greedy token
   agreement position by position. A bounded window changes a consumer layer's rows only
   within (consumer layers) x (window) positions of the replay start, through the layers
   above: 4 x 8 = 32 on the tiny model, far less than the default keep of 140, while on
   the released model 20 x 128 = 2,560 is far more. So the drift is also measured at the
   least keep allowed (window + backtracking), the closer analogue of the real model.

    .venv/bin/python benchmarks/bounded_replay.py [--preset tiny] [--prompts 8]
"""

import argparse
import random
import tempfile

import torch
from torch.utils.flop_counter import FlopCounterMode

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.models.deepseek_v41.model import MAX_BACKTRACK
from deepwell.engine.models.deepseek_v41.writer import PRESETS, write_tiny_checkpoint

MODES = ("off", "mask", "compact")
FIRST_TEXT_ID = 3  # below: BOS, EOS, pad of the byte-level tokenizer


def make_core(path: str, mode: str, keep: int, caching: bool) -> EngineCore:
    return EngineCore(
        EngineArgs(
            model=path,
            dtype="float32",
            quantize_kv_cache=False,
            max_model_len=4096,
            memory_gib=1.0,
            num_threads=1,
            # FlopCounterMode sees the ops of its own thread: keep the forward on this one.
            async_scheduling=False,
            enable_prefix_caching=caching,
            yoco_prefill_truncation_mode=mode,
            yoco_prefill_keep_tokens=keep,
        )
    )


def random_tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TEXT_ID, vocab_size) for _ in range(count)]


def prefill_flops(core: EngineCore, request_id: str, prompt: list[int]) -> tuple[int, int]:
    """Matmul FLOPs until the request's first token, and its prompt tokens taken from cache."""
    core.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0))
    with FlopCounterMode(display=False) as counter:
        while core.has_unfinished():
            for output in core.step():
                if output.new_token_ids:
                    cached = output.num_cached_tokens
    while core.has_unfinished():
        core.step()
    return counter.get_total_flops(), cached


def flops_ratios(path: str, args: argparse.Namespace, vocab_size: int) -> None:
    rng = random.Random(0)
    prefix = random_tokens(rng, args.prefix_tokens, vocab_size)
    first = prefix + random_tokens(rng, args.question_tokens, vocab_size)
    second = prefix + random_tokens(rng, args.question_tokens, vocab_size)
    cold = {
        mode: prefill_flops(make_core(path, mode, args.keep, caching=False), "cold", second)[0]
        for mode in MODES
    }
    print(f"prompt {len(second)} tokens, shared prefix {len(prefix)}, keep {args.keep}")
    ratios = ", ".join(f"{mode} {cold[mode] / cold['off']:.3f}" for mode in MODES)
    print(f"prefill FLOPs ratio (bounded/exact), cold prompt: {ratios}")
    parts = []
    for mode in MODES:
        core = make_core(path, mode, args.keep, caching=True)
        prefill_flops(core, "first", first)
        flops, cached = prefill_flops(core, "second", second)
        parts.append(f"{mode} {flops / cold['off']:.3f} ({cached} cached)")
    print(f"prefill FLOPs ratio (bounded/exact), hit: {', '.join(parts)}")


def greedy(core: EngineCore, request_id: str, prompt: list[int], tokens: int):
    """Greedy tokens, and the logits of the first sampled position."""
    captured = []
    compute_logits = core.runner.model.compute_logits

    def record(
        hidden: torch.Tensor, rows: torch.Tensor | None = None, float32: bool = True
    ) -> torch.Tensor:
        # float32 even where the greedy step would take the head's dtype: for the drift.
        logits = compute_logits(hidden, rows)
        captured.append(logits.clone())
        return logits

    core.runner.model.compute_logits = record
    core.add_request(
        request_id, prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    )
    out = []
    while core.has_unfinished():
        for output in core.step():
            out += output.new_token_ids
    core.runner.model.compute_logits = compute_logits
    return out, captured[0][0]


def drift(path: str, args: argparse.Namespace, vocab_size: int, keep: int) -> None:
    rng = random.Random(1)
    cores = {mode: make_core(path, mode, keep, caching=False) for mode in MODES}
    lengths = [rng.randrange(keep + 100, keep + 300) for _ in range(args.prompts)]
    results: dict[str, list] = {mode: [] for mode in MODES}
    for n, length in enumerate(lengths):
        prompt = random_tokens(rng, length, vocab_size)
        for mode, core in cores.items():
            results[mode].append(greedy(core, f"p{n}", prompt, args.output_tokens))
    print(
        f"drift against off, keep {keep}, over {args.prompts} prompts of "
        f"{min(lengths)}-{max(lengths)} tokens, {args.output_tokens} greedy tokens each:"
    )
    for mode in ("mask", "compact"):
        diffs = torch.cat(
            [
                (logits - exact[1]).abs()
                for (_, logits), exact in zip(results[mode], results["off"], strict=True)
            ]
        )
        same = sum(
            a == b
            for (tokens, _), (exact, _) in zip(results[mode], results["off"], strict=True)
            for a, b in zip(tokens, exact, strict=True)
        )
        total = args.prompts * args.output_tokens
        print(
            f"  {mode}: first-token logits max abs {diffs.max():.3e}, mean abs "
            f"{diffs.mean():.3e}; greedy token agreement {same}/{total} ({same / total:.1%})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--keep", type=int, default=140, help="yoco_prefill_keep_tokens")
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        written = write_tiny_checkpoint(directory, seed=0, text_config=PRESETS[args.preset])
        vocab_size = written.config["text_config"]["vocab_size"]
        print(f"DeepSeek-V4.1 {args.preset} checkpoint (random weights), float32, block 128")
        flops_ratios(directory, args, vocab_size)
        text = PRESETS[args.preset]
        least = text["sliding_window"] + MAX_BACKTRACK
        for keep in sorted({args.keep, least}, reverse=True):
            drift(directory, args, vocab_size, keep)


if __name__ == "__main__":
    main()
