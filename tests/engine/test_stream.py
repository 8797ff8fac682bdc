"""AsyncEngine: one async token stream per request, aborts, errors before queueing."""

import asyncio

import pytest

from deepwell.engine import AsyncEngine, InvalidRequestError, SamplingParams

from .tiny_llama import run_to_completion


@pytest.fixture
def engine(make_core):
    engine = AsyncEngine(make_core())
    yield engine
    engine.close()


async def collect(engine, request_id, prompt, params):
    tokens = []
    async for output in engine.generate(request_id, prompt, params):
        tokens += output.new_token_ids
        last = output
    return tokens, last


def test_concurrent_streams_match_the_synchronous_engine(engine, make_core):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = {"a": [5, 6, 7, 8], "b": list(range(10, 40))}

    async def main():
        return await asyncio.gather(*(collect(engine, k, p, params) for k, p in prompts.items()))

    (a, a_last), (b, b_last) = asyncio.run(main())
    core = make_core()
    for key, prompt in prompts.items():
        core.add_request(key, prompt, params)
    expected = run_to_completion(core)
    assert (a, b) == (expected["a"], expected["b"])
    assert a_last.finished and a_last.finish_reason.value == "length"


def test_leaving_a_stream_early_aborts_and_frees_its_blocks(engine):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        seen = 0
        async for _ in engine.generate("long", list(range(5, 50)), params):
            seen += 1
            if seen == 3:
                break
        # The abort is a command the engine thread applies before its next step.
        for _ in range(200):
            if engine.core.kv.block_pool.num_free == engine.core.kv.block_pool.num_blocks:
                return seen
            await asyncio.sleep(0.01)
        return -1

    assert asyncio.run(main()) == 3
    assert not engine.core.requests


def test_bad_request_raises_before_anything_is_queued(engine):
    async def main():
        async for _ in engine.generate("bad", [], SamplingParams()):
            pass

    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        asyncio.run(main())
    assert not engine.core.has_unfinished()
