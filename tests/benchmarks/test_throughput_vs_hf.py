"""benchmarks/throughput_vs_hf.py: the configurations each dtype and KV cache adds, and each
engine's best."""

import argparse
from pathlib import Path

import pytest
from throughput_vs_hf import cache_list, configurations, deepwell_name, dtype_list, fastest


def args_for(dtypes: list[str], caches: tuple[str, ...] = ("dynamic",)) -> argparse.Namespace:
    return argparse.Namespace(
        dtype=dtypes,
        quantizations=["none"],
        k=5,
        hf_batch_sizes=[32],
        hf_caches=list(caches),
        hf_continuous=False,
        llama_cpp=False,
        llama_cpp_cache=Path("/nonexistent"),
    )


def test_one_dtype_keeps_the_names_other_scripts_read():
    configs = configurations(args_for(["bfloat16"]))
    assert set(configs) == {
        "deepwell, speculation off",
        "deepwell, speculation on",
        "transformers static batch 32",
    }
    assert {extra["dtype"] for _, extra in configs.values()} == {"bfloat16"}


def test_two_dtypes_run_every_engine_in_each():
    configs = configurations(args_for(["bfloat16", "float32"]))
    assert configs["deepwell, speculation off (float32)"] == (
        "deepwell",
        {"k": 0, "quantization": "none", "dtype": "float32"},
    )
    assert configs["transformers static batch 32 (bfloat16)"][1]["dtype"] == "bfloat16"
    assert len(configs) == 6


def test_the_static_cache_is_one_more_transformers_configuration_a_batch_size():
    configs = configurations(args_for(["bfloat16"], ("dynamic", "static")))
    assert configs["transformers static batch 32"][1]["hf_cache"] == "dynamic"
    assert configs["transformers static batch 32, static cache"] == (
        "hf-static",
        {"batch_size": 32, "dtype": "bfloat16", "hf_cache": "static"},
    )
    assert len(configs) == 4


def test_an_engines_best_is_its_faster_dtype():
    names = [deepwell_name("none", "off", d) for d in ("bfloat16", "float32")]
    best = {names[0]: {"output_tok_s": 90.0}, names[1]: {"output_tok_s": 120.0}}
    assert fastest(best, names) == "deepwell, speculation off (float32)"
    assert fastest({names[0]: best[names[0]]}, names) == names[0]
    assert fastest({}, names) is None


def test_an_unknown_cache_is_refused():
    assert cache_list("static,dynamic") == ["static", "dynamic"]
    with pytest.raises(argparse.ArgumentTypeError, match="offloaded"):
        cache_list("dynamic,offloaded")


def test_an_unknown_dtype_is_refused():
    assert dtype_list("float32,bfloat16") == ["float32", "bfloat16"]
    with pytest.raises(argparse.ArgumentTypeError, match="float16"):
        dtype_list("bfloat16,float16")
