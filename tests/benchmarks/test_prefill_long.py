"""benchmarks/prefill_long.py's verdict: deepwell is ahead of a peer only where that peer ran
at every length and was slower at each; llama.cpp is set against deepwell's int4 run."""

from prefill_long import DEEPWELL, DEEPWELL_INT4, LLAMA_CPP, TRANSFORMERS, report


def figure(tok_s: float) -> dict:
    return {"tok_s": tok_s, "load_average": 1.0}


def test_ahead_needs_a_faster_deepwell_at_every_length():
    best = {
        (512, DEEPWELL): figure(1200.0),
        (512, TRANSFORMERS): figure(400.0),
        (512, DEEPWELL_INT4): figure(1500.0),
        (512, LLAMA_CPP): figure(300.0),
        (4096, DEEPWELL): figure(600.0),
        (4096, TRANSFORMERS): figure(650.0),
        (4096, DEEPWELL_INT4): figure(640.0),
        (4096, LLAMA_CPP): figure(200.0),
    }
    summary = report([512, 4096], [DEEPWELL, TRANSFORMERS, DEEPWELL_INT4, LLAMA_CPP], best)
    assert summary["512"]["ratios"] == {TRANSFORMERS: 3.0, LLAMA_CPP: 5.0}
    assert summary["4096"]["ratios"] == {TRANSFORMERS: 600.0 / 650.0, LLAMA_CPP: 3.2}
    assert summary["ahead_at_every_length"] == {TRANSFORMERS: False, LLAMA_CPP: True}


def test_a_peer_that_did_not_run_everywhere_gives_no_verdict():
    best = {
        (512, DEEPWELL): figure(1200.0),
        (512, TRANSFORMERS): figure(400.0),
        (4096, DEEPWELL): figure(600.0),
    }
    summary = report([512, 4096], [DEEPWELL, TRANSFORMERS], best)
    assert summary["4096"]["ratios"] == {}
    assert summary["ahead_at_every_length"] == {TRANSFORMERS: None, LLAMA_CPP: None}
