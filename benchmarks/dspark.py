"""DSpark drafting on a tiny DeepSeek-V4.1: acceptance per draft position, the mean accepted
length τ (tokens per decode step) and the speedup over no speculation, with the checkpoint's
random draft stages and again after training them briefly on the target's own greedy output.

Greedy, float32, cache quantisation off, one torch thread. Held-out prompts: the training
set is the greedy continuation of other random prompts. Batch-1 decode tok/s (each request
alone, after its first token) and the output tok/s of `--batch` concurrent requests, each
the best of `--repeats` alternating off/on runs (a shared machine swings single runs):

    .venv/bin/python benchmarks/dspark.py [--preset tiny|small] [--train-steps 400]
"""

import argparse
import random
import tempfile
import time

import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.models.deepseek_v41.dspark import DSpark
from deepwell.engine.models.deepseek_v41.writer import PRESETS, write_tiny_checkpoint


def engine(path: str, k: int, max_num_seqs: int, draft_state: dict | None = None) -> EngineCore:
    """An engine on the checkpoint; `draft_state` replaces its draft stages' weights."""
    core = EngineCore(
        EngineArgs(
            model=path,
            dtype="float32",
            quantize_kv_cache=False,
            num_speculative_tokens=k,
            speculative_method="dspark",
            max_num_seqs=max_num_seqs,
            max_model_len=1024,
            memory_gib=1.0,
            async_scheduling=False,
        )
    )
    if draft_state is not None and k:
        core.runner.model.dspark.load_state_dict(draft_state)
    return core


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab - 8) for _ in range(rng.randrange(8, 48))] for _ in range(count)
    ]


def run(core: EngineCore, batch: list[list[int]], max_tokens: int) -> tuple[int, float, dict]:
    """Decode tokens and seconds (after each request's first token) and the outputs."""
    for index, prompt in enumerate(batch):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        core.add_request(f"r{index}", prompt, params)
    outputs: dict[str, list[int]] = {}
    first = None
    while core.has_unfinished():
        for output in core.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        if first is None and outputs:
            first, first_count = time.perf_counter(), sum(map(len, outputs.values()))
    tokens = sum(map(len, outputs.values())) - first_count
    return tokens, time.perf_counter() - first, outputs


def measure(args, path: str, batch_prompts, concurrency: int) -> tuple[float, float, EngineCore]:
    """Best decode tok/s off and on over the repeats; the last speculating core."""
    best = {0: 0.0, args.k: 0.0}
    for _ in range(args.repeats):
        for k in (0, args.k):
            core = engine(path, k, concurrency, args.draft_state)
            if concurrency == 1:
                tokens = seconds = 0.0
                for prompt in batch_prompts:
                    n, s, _ = run(core, [prompt], args.max_tokens)
                    tokens, seconds = tokens + n, seconds + s
            else:
                tokens, seconds, _ = run(core, batch_prompts, args.max_tokens)
            best[k] = max(best[k], tokens / seconds)
            if k:
                on_core = core
    return best[0], best[args.k], on_core


def describe(core: EngineCore) -> str:
    stats = core.speculator.stats()
    rates = " ".join(f"{rate:.2f}" for rate in stats.position_accept_rates)
    return (
        f"accept per position {rates}; τ (tokens per decode step) {stats.tokens_per_decode:.2f}; "
        f"verified per drafting step {stats.avg_verified_len:.2f}; "
        f"confidence error {stats.confidence_error:.3f}"
    )


def report(args, path: str, label: str) -> None:
    vocab = PRESETS[args.preset]["vocab_size"]
    held_out = prompts(args.prompts, vocab, seed=1)
    off, on, core = measure(args, path, held_out[: args.single], 1)
    print(f"[{label}] batch 1: {describe(core)}")
    print(f"[{label}] batch-1 decode tok/s: off {off:.1f}, on {on:.1f}, speedup {on / off:.2f}")
    off, on, core = measure(args, path, held_out, args.batch)
    print(f"[{label}] batch {args.batch}: {describe(core)}")
    print(
        f"[{label}] batch-{args.batch} decode tok/s: off {off:.1f}, on {on:.1f}, "
        f"speedup {on / off:.2f}"
    )


def greedy_sequences(path: str, count: int, max_tokens: int, vocab: int) -> list[list[int]]:
    core = engine(path, 0, 64)
    batch = prompts(count, vocab, seed=2)
    _, _, outputs = run(core, batch, max_tokens)
    return [prompt + outputs[f"r{i}"] for i, prompt in enumerate(batch)]


def target_features(core: EngineCore, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence [len, targets·hidden]: what the target hands DSpark at each position,
    captured from the engine's own prefill."""
    dspark = core.runner.model.dspark
    captured: list[torch.Tensor] = []
    write = dspark.write_context

    def capture(features, positions, meta, rings):
        captured.append(torch.cat(features, dim=-1).clone())
        return write(features, positions, meta, rings)

    dspark.write_context = capture
    result = []
    for sequence in sequences:
        captured.clear()
        core.add_request("f", sequence, SamplingParams(max_tokens=1, temperature=0))
        while core.has_unfinished():
            core.step()
        result.append(torch.cat(captured)[: len(sequence)])
    dspark.write_context = write
    return result


def train(args, path: str) -> dict:
    """Train the draft stages (not the shared embedding and head) on the target's greedy
    output: cross-entropy of every block row against the next tokens, Markov head teacher-
    forced, plus the confidence head against whether the row's argmax was right."""
    vocab = PRESETS[args.preset]["vocab_size"]
    sequences = greedy_sequences(path, args.train_sequences, args.max_tokens, vocab)
    core = engine(path, args.k, 1)
    model = core.runner.model
    dspark: DSpark = model.dspark
    features = target_features(core, sequences)
    width = dspark.block_size
    rows = dspark.window + 8
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    trained = [p for p in dspark.parameters()]
    for parameter in trained:
        parameter.requires_grad_(True)
    optimizer = torch.optim.Adam(trained, lr=args.lr)
    rng = random.Random(0)
    first = dspark.stages[0]
    started = time.perf_counter()
    for step in range(args.train_steps):
        picks = [rng.randrange(len(sequences)) for _ in range(args.train_batch)]
        anchors = [rng.randrange(1, len(sequences[i]) - width) for i in picks]
        rings = [torch.zeros(len(picks), rows, model.config.head_dim) for _ in dspark.stages]
        for slot, (index, anchor) in enumerate(zip(picks, anchors, strict=True)):
            positions = torch.arange(max(0, anchor - dspark.window), anchor)
            main_x = first.main_norm(first.main_proj(features[index][positions]))
            rotation = dspark.rotary.rotation(positions)
            for stage, ring in zip(dspark.stages, rings, strict=True):
                ring[slot, positions % rows] = stage.context_rows(main_x, rotation)
        anchor_ids = torch.tensor([sequences[i][a] for i, a in zip(picks, anchors, strict=True)])
        targets = torch.tensor(
            [sequences[i][a + 1 : a + 1 + width] for i, a in zip(picks, anchors, strict=True)]
        )
        normed, hidden = dspark.block(
            model.embed,
            anchor_ids,
            torch.tensor(anchors),
            list(range(len(picks))),
            rings,
            rows,
            torch.float32,
        )
        previous = torch.cat((anchor_ids.unsqueeze(1), targets[:, :-1]), dim=1)
        transition, embedding = dspark.markov(previous.flatten())
        logits = model.compute_logits(normed).flatten(0, 1) + transition
        loss = torch.nn.functional.cross_entropy(logits, targets.flatten())
        right = (logits.argmax(-1) == targets.flatten()).float()
        confidence = dspark.confidence(hidden.flatten(0, 1), embedding)
        loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(confidence, right)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == args.train_steps - 1:
            print(
                f"train step {step}: loss {loss.item():.3f}, row accuracy "
                f"{right.mean().item():.2f} ({time.perf_counter() - started:.0f}s)"
            )
    return {name: tensor.detach().clone() for name, tensor in dspark.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens when on")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (batch run)")
    parser.add_argument("--single", type=int, default=4, help="of them run alone")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=400, help="0: no training")
    parser.add_argument("--train-sequences", type=int, default=128)
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.draft_state = None
    with tempfile.TemporaryDirectory() as directory:
        path = str(write_tiny_checkpoint(directory, seed=0, text_config=PRESETS[args.preset]).path)
        report(args, path, "random draft")
        if args.train_steps:
            args.draft_state = train(args, path)
            report(args, path, "trained draft")


if __name__ == "__main__":
    main()
