"""`deepwell serve`'s cluster options: worker roles and the combinations refused."""

import argparse

import pytest

from deepwell.serve.cluster.options import ClusterBackend, cluster_backend, worker_roles
from deepwell.serve.settings import add_arguments


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_workers_are_mixed_by_default():
    assert worker_roles(parse()) == ["mixed"]
    assert worker_roles(parse("--workers", "3")) == ["mixed"] * 3


def test_pd_starts_prefill_then_decode_workers():
    args = parse("--prefill-workers", "1", "--decode-workers", "2", "--kv-store", "/tmp/kv")
    assert worker_roles(args) == ["prefill", "decode", "decode"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--workers", "0"), "must be positive"),
        (("--prefill-workers", "1"), "needs --prefill-workers and --decode-workers both"),
        (("--prefill-workers", "1", "--decode-workers", "1"), "needs --kv-store"),
        (
            (
                "--prefill-workers",
                "1",
                "--decode-workers",
                "1",
                "--workers",
                "2",
                "--kv-store",
                "x",
            ),
            "does not combine",
        ),
    ],
)
def test_impossible_combinations_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        worker_roles(parse(*argv))


def test_data_parallel_ranks_are_the_workers_of_this_machine():
    assert worker_roles(parse("--data-parallel-size", "4", "--expert-parallel")) == ["mixed"] * 4
    assert worker_roles(parse("--data-parallel-size", "4", "--nnodes", "2")) == ["mixed"] * 2
    with pytest.raises(ValueError, match="does not combine with --workers"):
        worker_roles(parse("--data-parallel-size", "2", "--workers", "2"))


def test_encoder_workers_follow_the_engine_workers():
    assert worker_roles(parse("--encoder-workers", "2")) == ["mixed", "encoder", "encoder"]
    pd = ("--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "/tmp/kv")
    args = parse("--encoder-workers", "1", *pd)
    assert worker_roles(args) == ["prefill", "decode", "encoder"]
    with pytest.raises(ValueError, match="does not combine with --data-parallel-size"):
        worker_roles(parse("--encoder-workers", "1", "--data-parallel-size", "2"))
    with pytest.raises(ValueError, match="must be positive"):
        worker_roles(parse("--encoder-workers", "-1"))


def test_cluster_is_local_by_default_and_ray_takes_an_optional_address():
    assert parse().cluster == ClusterBackend("local", None)
    assert parse("--cluster", "ray").cluster == ClusterBackend("ray", None)
    assert parse("--cluster", "ray=10.0.0.1:6379").cluster == ClusterBackend("ray", "10.0.0.1:6379")
    assert parse("--cluster", "ray=auto").cluster == ClusterBackend("ray", "auto")


@pytest.mark.parametrize("text", ["ray=", "kubernetes", "local=x"])
def test_an_unknown_cluster_is_refused_with_the_forms_it_takes(text):
    with pytest.raises(argparse.ArgumentTypeError, match="local, ray or ray=ADDRESS"):
        cluster_backend(text)
