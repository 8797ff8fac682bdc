"""Workload W, the benchmarks' own copy: it must rebuild the W every quoted figure ran on."""

from workload import W_SHA256, make_workload, summary, workload_sha256


def test_the_default_workload_is_w_as_first_recorded():
    # The sha256 and token totals docs/benchmarks-log.md quotes for W.
    facts = summary(make_workload())
    assert facts["sha256"] == W_SHA256
    assert (facts["n"], facts["prompt_tokens"], facts["output_tokens"]) == (64, 19_021, 10_407)


def test_every_request_stays_inside_ws_ranges():
    for index, request in enumerate(make_workload()):
        assert request["id"] == index
        assert 64 <= request["prompt_len"] <= 512
        assert 64 <= request["output_len"] <= 256
        assert len(request["prompt_ids"]) == request["prompt_len"]
        assert all(17 <= token < 49152 for token in request["prompt_ids"])


def test_another_seed_gives_another_workload():
    assert workload_sha256(make_workload(seed=1)) != W_SHA256
