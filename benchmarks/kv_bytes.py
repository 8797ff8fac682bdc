"""DeepSeek-V4.1's caches in their released bytes against rounded values in the compute
dtype: the bytes (the released shape) and the step time (a random small checkpoint).

1. Bytes a token of paged KV and a sequence's slot (window rings, compressor tails) take
   for the released schedule and widths (head_dim 512, index_head_dim 128, 40 layers, 3
   DSpark stages), packed and as bfloat16 rounded values, from the layout the model declares.
2. Step time on the `small` preset in bfloat16 at one thread, the model driven directly
   (the runner's step plans, the same steps for both): two 512-token prompts prefilled in
   128-row chunks, then 64 decode steps of both; best of `--repeats` runs each, alternating.
   CPU seconds of this process, which a machine shared with busy neighbours disturbs less
   than wall time.

    .venv/bin/python benchmarks/kv_bytes.py [--preset small] [--repeats 4]
"""

import argparse
import dataclasses
import tempfile
import time

import torch

from deepwell.engine.kv.cache import KVCache
from deepwell.engine.layers.step_metadata import SequenceSpan, StepMetadata
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.models.deepseek_v41.config import DeepseekV41Config
from deepwell.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM, kv_layout
from deepwell.engine.models.deepseek_v41.writer import (
    PRESETS,
    RELEASED_CACHE_SHAPE,
    write_tiny_checkpoint,
)
from deepwell.engine.models.loader import load_checkpoint
from deepwell.engine.models.registry import ModelOptions
from deepwell.engine.runner import ModelRunner

BLOCK = 16
PROMPT = 512
CHUNK = 128
DECODES = 64


def released_bytes() -> None:
    config = DeepseekV41Config.from_hf(RELEASED_CACHE_SHAPE)
    for name, packed in (("packed", True), ("bfloat16 rounded", False)):
        layout = kv_layout(dataclasses.replace(config, cache_packed=packed), dspark=True)
        token = layout.block_bytes(128, torch.bfloat16) / 128
        slot = layout.slot_bytes(torch.bfloat16)
        snapshot_slot = layout.with_snapshot_rows(128).slot_bytes(torch.bfloat16)
        print(
            f"  {name}: paged {token:.0f} B/token ({token * 2**20 / 2**30:.2f} GiB for 1M "
            f"tokens); slot {slot / 2**20:.2f} MiB ({snapshot_slot / 2**20:.2f} MiB with the "
            "snapshot rows of prefix caching)"
        )


class Driver:
    """One model on the same hand-made steps: its own caches and the runner's plans."""

    def __init__(self, model: DeepseekV41ForCausalLM, blocks: int) -> None:
        layout = model.kv_layout()
        self.cache = KVCache.allocate(layout, 2 * blocks, BLOCK, 2, model.dtype)
        # It hands out every block and slot itself, so clears them as the manager would.
        self.cache.clear_blocks(list(range(2 * blocks)))
        for slot in range(2):
            self.cache.clear_slot(slot)
        self.runner = ModelRunner(model, self.cache, BLOCK, False, layout)
        self.blocks = blocks

    def step(self, sequences: list[list[int]], start: int, rows: int) -> None:
        depth = self.runner.token_history
        ids, positions, spans, history = [], [], [], []
        for index, tokens in enumerate(sequences):
            first = index * self.blocks
            table = torch.arange(first, first + -(-(start + rows) // BLOCK))
            spans.append(SequenceSpan(len(ids), rows, start, index, table))
            ids += tokens[start : start + rows]
            positions += range(start, start + rows)
            for p in range(start, start + rows):
                history.append([tokens[p - s] if p >= s else -1 for s in range(1, depth + 1)])
        meta = StepMetadata(spans)
        self.runner.plan_caches(meta)
        meta.token_history = torch.tensor(history).view(-1, depth)
        with torch.inference_mode():
            self.runner.model(torch.tensor(ids), torch.tensor(positions), meta, self.cache)


def step_times(preset: str, repeats: int) -> None:
    torch.set_num_threads(1)
    dtype = torch.bfloat16
    with tempfile.TemporaryDirectory() as directory:
        written = write_tiny_checkpoint(directory, seed=0, text_config=PRESETS[preset])
        loaded = load_checkpoint(str(written.path))
        options = ModelOptions(dtype=dtype, backend_class=TorchPagedAttention)
        packed = DeepseekV41ForCausalLM.from_checkpoint(loaded, options)
        rounded_config = dataclasses.replace(packed.config, cache_packed=False)
        rounded = DeepseekV41ForCausalLM(rounded_config, dtype, packed.engram_tables)
        rounded.tensor_schema = packed.tensor_schema  # what from_checkpoint reads off config.json
        for model in (packed, rounded):
            model.load_weights(loaded.tensors)
    generator = torch.Generator().manual_seed(0)
    vocab = packed.config.vocab_size
    length = PROMPT + DECODES
    sequences = [torch.randint(3, vocab, (length,), generator=generator).tolist()] * 2
    sequences[1] = list(reversed(sequences[0]))
    blocks = -(-length // BLOCK)
    best: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, model in (("packed", packed), ("bfloat16 rounded", rounded)):
            driver = Driver(model, blocks)
            started = time.process_time()
            for start in range(0, PROMPT, CHUNK):
                driver.step(sequences, start, CHUNK)
            prefilled = time.process_time()
            for position in range(PROMPT, length):
                driver.step(sequences, position, 1)
            done = time.process_time()
            times = best.setdefault(name, [float("inf")] * 2)
            times[0] = min(times[0], prefilled - started)
            times[1] = min(times[1], (done - prefilled) / DECODES)
            token = driver.runner.layout.block_bytes(BLOCK, dtype) / BLOCK
            best[f"{name} bytes"] = [token, driver.runner.layout.slot_bytes(dtype)]
    for name in ("packed", "bfloat16 rounded"):
        prefill, decode = best[name]
        token, slot = best[f"{name} bytes"]
        print(
            f"  {name}: prefill 2 x {PROMPT} {prefill:.2f} CPU s, decode {decode * 1e3:.1f} "
            f"CPU ms/step (2 rows); paged {token:.0f} B/token, slot {slot} B"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    print("DeepSeek-V4.1 released shape (bytes from the declared layout)")
    released_bytes()
    print(f"DeepSeek-V4.1 {args.preset} checkpoint (random weights), bfloat16, one thread")
    step_times(args.preset, args.repeats)


if __name__ == "__main__":
    main()
