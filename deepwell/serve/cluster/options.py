"""Command-line options of a cluster of engine workers behind one `deepwell serve`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from deepwell.serve.cluster.routing import POLICIES
from deepwell.serve.cluster.worker_pool import HUNG_WORKER_TIMEOUT_S

# Ray's placement group strategies (`--ray-placement`); "auto" picks one by the layout.
RAY_PLACEMENTS = ("auto", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class ClusterBackend:
    """Who starts and restarts the workers: this process ("local" subprocesses) or Ray
    (`address` as `ray.init` takes it; None: RAY_ADDRESS, else a new single-node Ray)."""

    kind: str = "local"
    address: str | None = None


def cluster_backend(text: str) -> ClusterBackend:
    """`--cluster`: local, ray, or ray=ADDRESS (auto, HOST:PORT of the head's GCS, ray://...)."""
    kind, equals, address = text.partition("=")
    if kind == "local" and not equals:
        return ClusterBackend()
    if kind == "ray" and (address or not equals):
        return ClusterBackend("ray", address or None)
    raise argparse.ArgumentTypeError(
        f"--cluster takes local, ray or ray=ADDRESS (auto, or the head's HOST:PORT), got {text!r}"
    )


# A request charged with this many worker crashes is failed instead of rerouted again
# (request_router.py); two tells a request that kills workers from a worker killed under it.
WORKER_CRASHES_PER_REQUEST = 2


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers", type=int, default=1, help="engine worker processes behind this front end"
    )
    parser.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="PD disaggregation: workers that compute prompts and write their KV to --kv-store",
    )
    parser.add_argument(
        "--decode-workers",
        type=int,
        default=0,
        help="PD disaggregation: workers that load a prompt's KV from --kv-store and decode",
    )
    parser.add_argument(
        "--encoder-workers",
        type=int,
        default=0,
        help="EPD: workers that load only the vision tower and encode requests' images, "
        "handing the embeddings to the prefill (or mixed) worker with the request",
    )
    parser.add_argument(
        "--worker-address",
        metavar="tcp://HOST:PORT",
        help="also accept workers started elsewhere with `deepwell worker --connect` here",
    )
    parser.add_argument(
        "--routing-policy",
        choices=sorted(POLICIES),
        default="least-outstanding",
        help="how a request picks its worker (default: least outstanding tokens, ties to the "
        "longest prefix hit)",
    )
    parser.add_argument(
        "--no-eviction-reports",
        dest="eviction_reports",
        action="store_false",
        help="route by what was sent to each worker alone, ignoring the prefix blocks the "
        "workers report cached and evicted (the router before the reports; "
        "benchmarks/serve_cluster.py --pressure compares the two)",
    )
    parser.add_argument(
        "--drain-max-utilisation",
        type=float,
        default=0.8,
        help="quota guard: refuse to drain a worker if the others would exceed this KV "
        "utilisation (default: 0.8)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds a draining worker's requests may take to finish before they move",
    )
    _add_worker_loss_arguments(parser)

    _add_ray_arguments(parser.add_argument_group("the cluster on Ray (--cluster ray)"))


def _add_worker_loss_arguments(parser: argparse.ArgumentParser) -> None:
    """When a worker counts as lost, and what a request that keeps losing them gets."""
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=1.0,
        help="seconds without a heartbeat after which a worker that joined from another "
        "machine (`deepwell worker --connect`) is taken for dead",
    )
    parser.add_argument(
        "--hung-worker-timeout",
        type=float,
        default=HUNG_WORKER_TIMEOUT_S,
        help="seconds a worker this server started (a local process or a Ray actor, whose "
        "exit it sees at once) may send no heartbeat before it is taken for hung, killed "
        "and restarted; a long step on a loaded machine can starve its heartbeats for "
        f"seconds (default: {HUNG_WORKER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--worker-crashes-per-request",
        type=positive_int,
        default=WORKER_CRASHES_PER_REQUEST,
        metavar="N",
        help="a request charged with N worker crashes (it was sent to a worker that died "
        "before answering it, or in flight when one died mid-decode) ends with a 500 error "
        "naming its request id instead of being rerouted again; the other requests on the "
        f"worker move on (default: {WORKER_CRASHES_PER_REQUEST})",
    )


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_ray_arguments(ray: argparse._ArgumentGroup) -> None:
    ray.add_argument(
        "--cluster",
        type=cluster_backend,
        default=ClusterBackend(),
        metavar="local|ray[=ADDRESS]",
        help="who starts the engine workers: local subprocesses (default), or Ray actors placed "
        "on the nodes of a Ray cluster: ray=auto joins the cluster `ray start` runs on this "
        "machine, ray=HOST:6379 a head elsewhere, plain ray uses RAY_ADDRESS or starts a "
        "single-node Ray (needs the `ray` extra: pip install 'deepwell[ray]')",
    )
    ray.add_argument(
        "--ray-placement",
        choices=RAY_PLACEMENTS,
        default="auto",
        help="the workers' placement group strategy; auto: STRICT_PACK for an "
        "expert-parallel group (its all-to-all each MoE layer stays on one node), SPREAD "
        "otherwise (a lost node takes the fewest workers)",
    )
    ray.add_argument(
        "--ray-cpus-per-worker",
        type=float,
        default=1.0,
        metavar="N",
        help="CPUs each worker's bundle reserves on its node (default: 1)",
    )
    ray.add_argument(
        "--ray-max-restarts",
        type=int,
        default=-1,
        metavar="N",
        help="times Ray restarts a dead worker actor (-1: without end; 0: never) (default: -1)",
    )


def worker_roles(args: argparse.Namespace) -> list[str]:
    """One role per worker to start: all "mixed", or prefill ones then decode ones; then
    the encoder workers.

    Raises `ValueError` for combinations that cannot run.
    """
    if args.encoder_workers < 0:
        raise ValueError("worker counts must be positive")
    if args.encoder_workers and args.data_parallel_size > 1:
        raise ValueError("--encoder-workers does not combine with --data-parallel-size")
    return _engine_roles(args) + ["encoder"] * args.encoder_workers


def _engine_roles(args: argparse.Namespace) -> list[str]:
    prefill, decode = args.prefill_workers, args.decode_workers
    if prefill < 0 or decode < 0 or args.workers < 1:
        raise ValueError("worker counts must be positive")
    ranks, nodes = args.data_parallel_size, args.nnodes
    if ranks > 1:
        # Each data-parallel rank is a worker (its own engine, requests routed to it).
        if args.workers != 1 or prefill or decode:
            raise ValueError(
                "--data-parallel-size starts one worker per rank; it does not combine with "
                "--workers or --prefill-workers/--decode-workers"
            )
        if nodes < 1 or ranks % nodes:
            raise ValueError(f"--data-parallel-size {ranks} must be a multiple of --nnodes {nodes}")
        return ["mixed"] * (ranks // nodes)
    if not prefill and not decode:
        return ["mixed"] * args.workers
    if not prefill or not decode:
        raise ValueError("PD disaggregation needs --prefill-workers and --decode-workers both")
    if args.workers != 1:
        raise ValueError("--workers does not combine with --prefill-workers/--decode-workers")
    if args.kv_store_path is None or not args.enable_prefix_caching:
        raise ValueError(
            "PD disaggregation moves KV through the store: it needs --kv-store and prefix caching"
        )
    return ["prefill"] * prefill + ["decode"] * decode
