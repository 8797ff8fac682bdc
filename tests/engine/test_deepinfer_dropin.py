"""A script written against DeepInfer 0.1.0's documented offline API (spec/deepinfer.md §1.3,
§1.5) runs on deepwell after changing only its import, and its seeded outputs repeat: in
batch-invariant mode, and in the default configuration from one run of the script to the next.

The script below is DeepInfer's API only: its constructor arguments, `generate` with strings
and with token ids, every SamplingParams field (seq_seed, so_args json/regex/ebnf,
prompt_logprobs, top_logprobs, first_n_token_no_eos + eos_id, golden_token_ids, a
temperature below 1e-5, max_tokens=0), decode_sequence both ways, and close().
"""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.engine.models.loader import embedded_model_path

DEEPINFER_IMPORT = "from deepinfer import LLM, SamplingParams"
DEEPWELL_IMPORT = "from deepwell.engine import LLM, SamplingParams"
GOLDEN = [40, 41, 42]
REPO = Path(__file__).resolve().parents[2]

DEEPINFER_SCRIPT = f"""
import json
import sys

{DEEPINFER_IMPORT}

model, eos_id = sys.argv[1], int(sys.argv[2])
prompts = ["The capital of France is", "def fibonacci(n):"]
engine_args = dict(max_model_len=512, max_num_seqs=8, seed=0)

llm = LLM(
    model,
    tokenizer=None,
    trust_remote_code=False,
    expert_parallel_size=1,
    revision=None,
    tokenizer_revision=None,
    gpu_memory_utilization=0.9,
    decode_sequence=True,
    chunked_prefill=False,
    tokens_per_block=-1,
    load_format="auto",
    data_parallel_size=0,
    context_parallel_size=1,
    engram_parallel_size=0,
    engine_rank=0,
    disable_log_stats=True,
    **engine_args,
)
seeded = SamplingParams(
    temperature=0.8, top_p=0.95, top_k=50, max_tokens=12, seq_seed=2**64 - 5, ignore_eos=True
)
results = {{}}
results["strings"] = llm.generate(prompts, seeded, use_tqdm=False)
results["strings_again"] = llm.generate(prompts, seeded, use_tqdm=False, multi_modal_data=None)
results["from_ids"] = llm.generate(
    prompt_token_ids=[[10, 11, 12, 13], [50, 60, 70]],
    sampling_params=[SamplingParams(max_tokens=6, seq_seed=s, ignore_eos=True) for s in (1, 2)],
    use_tqdm=False,
)
results["near_zero_temperature"] = llm.generate(
    prompts[0], SamplingParams(temperature=1e-7, max_tokens=6, seq_seed=3, ignore_eos=True),
    use_tqdm=False,
)
results["regex"] = llm.generate(
    prompts[0],
    SamplingParams(max_tokens=12, seq_seed=6, so_args={{"schema_type": "regex", "schema": "[a-c]{{4}}"}}),
    use_tqdm=False,
)
schema = {{
    "type": "object",
    "properties": {{"a": {{"enum": [1, 2, 3]}}}},
    "required": ["a"],
    "additionalProperties": False,
}}
results["json"] = llm.generate(
    prompts[0],
    SamplingParams(max_tokens=40, seq_seed=7, so_args={{"schema_type": "json", "schema": json.dumps(schema)}}),
    use_tqdm=False,
)
results["ebnf"] = llm.generate(
    prompts[0],
    SamplingParams(max_tokens=8, seq_seed=8, so_args={{"schema_type": "ebnf", "schema": 'root ::= "yes" | "no"'}}),
    use_tqdm=False,
)
llm.close()
llm.close()

with LLM(model, decode_sequence=False, **engine_args) as raw:
    outputs = raw.generate(
        prompt_token_ids=[[10, 11, 12, 13, 14, 15]] * 2,
        sampling_params=[
            SamplingParams(
                max_tokens=5, seq_seed=9, logprobs=True, top_logprobs=1000, prompt_logprobs=True,
                golden_token_ids={GOLDEN}, ignore_eos=True,
            ),
            SamplingParams(max_tokens=0, seq_seed=10, first_n_token_no_eos=1, eos_id=eos_id),
        ],
        use_tqdm=False,
    )
    results["outputs"] = [
        {{
            "request_id": o.request_id,
            "token_id": list(o.token_id),
            "finished": o.finished,
            "top_logprobs": [len(step.top) for step in o.logprobs],
            "prompt_logprobs": len(o.prompt_logprobs),
        }}
        for o in outputs
    ]
print(json.dumps(results))
"""


def write_script(tmp_path: Path) -> Path:
    """DeepInfer's script with its import changed, and nothing else."""
    script = DEEPINFER_SCRIPT.replace(DEEPINFER_IMPORT, DEEPWELL_IMPORT)
    assert script.count("\n") == DEEPINFER_SCRIPT.count("\n")
    changed = [
        a for a, b in zip(script.splitlines(), DEEPINFER_SCRIPT.splitlines(), strict=True) if a != b
    ]
    assert changed == [DEEPWELL_IMPORT]
    path = tmp_path / "offline_inference.py"
    path.write_text(script)
    return path


def run_script(tmp_path: Path, model: str, eos_id: int, capsys, monkeypatch) -> dict:
    """The changed script, run as __main__ in this process, batch-invariant."""
    path = write_script(tmp_path)
    # DeepInfer's recipe for repeatable seeded samples (spec/deepinfer.md §1.1): batch-invariant
    # kernels and verify lengths that do not follow the load; deepwell's batch-invariant mode
    # gives both (DSpark's verify lengths otherwise follow measured step times).
    monkeypatch.setenv("DEEPWELL_BATCH_INVARIANT", "1")
    monkeypatch.setattr(sys, "argv", [str(path), model, str(eos_id)])
    capsys.readouterr()
    runpy.run_path(str(path), run_name="__main__")
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def check_results(results: dict, vocab_size: int) -> None:
    strings = results["strings"]
    assert len(strings) == 2 and all(isinstance(s, str) and s for s in strings)
    assert results["strings_again"] == strings
    assert len(results["from_ids"]) == 2
    assert re.fullmatch("[a-c]{4}", results["regex"][0])
    assert json.loads(results["json"][0])["a"] in (1, 2, 3)
    assert results["ebnf"][0] in ("yes", "no")
    forced, one = results["outputs"]
    assert forced["token_id"][: len(GOLDEN)] == GOLDEN
    assert len(forced["token_id"]) == 5 and forced["finished"]
    # top_logprobs=1000 on a smaller vocabulary: every token.
    assert forced["top_logprobs"] == [min(1000, vocab_size)] * 5
    assert forced["prompt_logprobs"] == 5
    assert len(one["token_id"]) == 1  # max_tokens=0 is 1


def run_script_process(path: Path, model: str, eos_id: int) -> dict:
    """The changed script run as a program of its own, in the default configuration: no
    DEEPWELL_* switch set, so neither batch-invariant mode nor anything else this process
    may have turned on."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DEEPWELL_")}
    # One torch thread, as this suite runs (conftest.py): two spinning threads on the shared
    # test machine's two cores ran the pair of runs 20x slower. Threads are the machine's,
    # not the engine configuration under test.
    environ["OMP_NUM_THREADS"] = "1"
    # The deepwell under test, wherever pytest runs from.
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, str(path), model, str(eos_id)],
        env=environ,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def check_default_configuration_repeats(tmp_path: Path, model: str, eos_id: int) -> dict:
    """Two runs of the script, each its own process (fresh engine, threads, caches and
    hash seeds): every seeded output, string or token, the same."""
    path = write_script(tmp_path)
    first = run_script_process(path, model, eos_id)
    assert run_script_process(path, model, eos_id) == first
    return first


@pytest.fixture(scope="module")
def tiny_v41(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=3, draw_stored=True)


def test_the_deepinfer_script_runs_on_a_tiny_v41_checkpoint(
    tiny_v41, tmp_path, capsys, monkeypatch
):
    config = json.loads((tiny_v41.path / "config.json").read_text())
    eos = config["eos_token_id"]
    results = run_script(tmp_path, str(tiny_v41.path), eos, capsys, monkeypatch)
    check_results(results, config["text_config"]["vocab_size"])
    assert eos not in results["outputs"][1]["token_id"]


@pytest.mark.slow
def test_the_deepinfer_script_runs_on_the_embedded_model(tmp_path, capsys, monkeypatch):
    results = run_script(tmp_path, str(embedded_model_path()), 2, capsys, monkeypatch)
    check_results(results, 49152)


def test_the_deepinfer_script_repeats_in_the_default_configuration_on_a_tiny_v41(
    tiny_v41, tmp_path
):
    config = json.loads((tiny_v41.path / "config.json").read_text())
    results = check_default_configuration_repeats(
        tmp_path, str(tiny_v41.path), config["eos_token_id"]
    )
    check_results(results, config["text_config"]["vocab_size"])


@pytest.mark.slow
def test_the_deepinfer_script_repeats_in_the_default_configuration_on_the_embedded_model(
    tmp_path,
):
    results = check_default_configuration_repeats(tmp_path, str(embedded_model_path()), 2)
    check_results(results, 49152)
