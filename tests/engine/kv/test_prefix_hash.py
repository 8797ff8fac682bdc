"""The prefix hash chain: keys that cover every token before them, the same in the engine
and in the front end's prefix index."""

from deepwell.engine import SamplingParams
from deepwell.engine.kv.prefix_hash import chain_keys, prompt_block_keys

PROMPT = [(11 * i) % 290 + 5 for i in range(70)]


def test_a_block_key_covers_every_token_before_it():
    tokens = list(range(40))
    keys = chain_keys(b"root", tokens, 8, 0, 5)
    assert keys == chain_keys(b"root", tokens, 8, 0, 5)
    assert keys[3:] == chain_keys(keys[2], tokens, 8, 3, 5)
    changed = [99] + tokens[1:]
    assert not set(chain_keys(b"root", changed, 8, 0, 5)) & set(keys)
    assert not set(chain_keys(b"other model", tokens, 8, 0, 5)) & set(keys)


def test_only_full_blocks_of_a_prompt_have_keys():
    assert len(prompt_block_keys(b"root", list(range(300)), 128)) == 2
    assert prompt_block_keys(b"root", list(range(127)), 128) == []


def test_the_front_end_keys_a_prompt_as_the_engine_does(make_core):
    core = make_core(block_size=16)
    core.add_request("r", PROMPT, SamplingParams(max_tokens=4, temperature=0))
    core.step()  # admission keys the prompt's full blocks to look them up
    engine_keys = core.requests["r"].block_keys
    assert len(engine_keys) == len(PROMPT) // 16
    # The front end has the root as the worker reports it (ModelInfo.fingerprint, hex).
    root = bytes.fromhex(core.kv.root_key.hex())
    assert engine_keys == prompt_block_keys(root, PROMPT, 16)


def test_an_image_keys_the_blocks_its_span_reaches_and_every_block_after():
    tokens = [7] * 40  # the image's span [10, 22) holds the same id whichever image it is
    keys = {h: prompt_block_keys(b"root", tokens, 8, [(10, 22, h)]) for h in ("cat", "dog")}
    assert keys["cat"][0] == keys["dog"][0] == prompt_block_keys(b"root", tokens, 8)[0]
    assert not set(keys["cat"][1:]) & set(keys["dog"][1:])
    assert keys["cat"] == prompt_block_keys(b"root", tokens, 8, [(10, 22, "cat")])
