"""Mirror context parallelism over DeepSeek-V4.1's packed caches (the released bytes, the
default): rank 0 decodes the rows before a chunk for the other ranks and packs what they
gathered. Its own module: a context-parallel core holds the process's one process group."""

import torch

from deepwell.engine import SamplingParams

from .v41_cores import CHUNKED, make_core, prompt, sequence_state


def test_packed_caches_after_a_parallel_prefill_hold_the_one_rank_bytes(checkpoint):
    # Two 300-token prompts sharing 256 tokens: a second chunk at 256, then a prefix hit
    # there, both reading rank 0's packed rows.
    cores = [
        make_core(checkpoint, quantize_kv_cache=True, **extra)
        for extra in ({}, {"context_parallel_size": 2})
    ]
    first = prompt(CHUNKED, 7)
    second = first[:256] + prompt(44, 8)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        for index, ids in enumerate((first, second)):
            states, tokens = [], []
            for core in cores:
                core.add_request(f"p{index}", ids, params)
                while core.requests[f"p{index}"].num_computed_tokens < len(ids):
                    core.step()
                states.append(sequence_state(core, f"p{index}"))
                tokens.append([])
                while core.has_unfinished():
                    tokens[-1] += [t for output in core.step() for t in output.new_token_ids]
            assert tokens[0] == tokens[1]
            expected, got = states
            assert got["window[0]"].dtype == got["compressed_r1[0]"].dtype == torch.uint8
            storage = cores[0].runner.model.layers[0].attn.storage
            for name in expected:
                if got[name].dtype != torch.uint8:  # the float32 compressor tails
                    torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5)
                    continue
                # Values, not bytes: rank 0 packs rows the ranks already rounded, and an
                # fp8 group may then take half the scale and twice the codes.
                rows = storage.window
                if name.startswith("compressed"):
                    rows = storage.entries
                elif name.startswith("index_keys"):
                    rows = storage.index_keys
                values = [rows.decode(state[name], torch.float32) for state in states]
                # Float sums in another order may move a value across a rounding edge.
                same = (values[0] == values[1]).float().mean().item()
                assert same > 0.99, (name, same)
        assert cores[1].stats().prefix_hit_tokens == 256
    finally:
        for core in cores:
            core.close()
