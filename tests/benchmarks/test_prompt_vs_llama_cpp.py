"""benchmarks/prompt_vs_llama_cpp.py: the prompt both engines read."""

import prompt_vs_llama_cpp as prompt
from workload import VOCAB


def test_the_prompt_is_n_ordinary_token_ids_the_same_every_run():
    ids = prompt.prompt_ids(512)
    assert len(ids) == 512 and ids == prompt.prompt_ids(512)
    assert all(VOCAB[0] <= token < VOCAB[1] for token in ids)
    # Not one id repeated: a prompt of distinct-enough tokens, as W's are.
    assert len(set(ids)) > 400
