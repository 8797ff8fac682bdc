"""Grammar masks apply to every verify row: constrained output is the same with speculation
on and off (seeded), and the matcher ends where the accepted tokens leave it."""

import json

import jsonschema

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.structured import StructuredOutput

from ..structured.tiny_tokenizer import tiny_tokenizer
from ..tiny_llama import run_to_completion, write_tiny_llama

SCHEMA = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["tags", "n"],
    "additionalProperties": False,
}


def test_constrained_output_is_identical_with_speculation_on_and_off(tmp_path):
    path = write_tiny_llama(tmp_path)
    tokenizer = tiny_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    prompt = tokenizer.encode('{"tags": ["alpha", "alpha", "alpha", "alpha"], "n": 1}').ids

    def generate(k: int) -> tuple[list[list[int]], int]:
        core = EngineCore(
            EngineArgs(
                model=str(path),
                dtype="float32",
                block_size=16,
                memory_gib=0.25,
                num_speculative_tokens=k,
            )
        )
        for seed in range(4):
            params = SamplingParams(
                max_tokens=60,
                temperature=0.7 if seed else 0.0,
                seed=seed,
                structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA)),
            )
            core.add_request(f"r{seed}", prompt, params)
        tokens = run_to_completion(core)
        verified = core.stats().spec.verified_tokens
        return [tokens[f"r{seed}"] for seed in range(4)], verified

    on, verified = generate(5)
    off, _ = generate(0)
    assert on == off
    assert verified > 0
    for tokens in on:
        text = tokenizer.decode([t for t in tokens if t != 2])
        jsonschema.validate(json.loads(text), SCHEMA)
