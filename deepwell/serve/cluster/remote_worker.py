"""`deepwell worker --connect tcp://HOST:PORT`: an engine worker that joins a running front end.

It takes `deepwell serve`'s engine options, binds its inbox on `--host`/`--port` (the
address the front end will reach it at) and announces itself with its model fingerprint;
a front end serving another model refuses it.
"""

from __future__ import annotations

import argparse
import logging
import secrets

from deepwell.serve.settings import add_arguments

# Local workers are numbered from 0; a joining worker picks an id far above them.
_FIRST_REMOTE_ID = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.add_argument(
        "--connect",
        required=True,
        metavar="tcp://HOST:PORT",
        help="the front end's --worker-address",
    )
    # The inbox's port; 0 picks a free one.
    parser.set_defaults(port=0)


def run(args: argparse.Namespace) -> int:
    # Imported here: the engine (torch) loads only in the worker command.
    from deepwell.serve import worker
    from deepwell.serve.launcher import worker_config

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.data_parallel_size > 1:
        # Ranks are numbered by the serve that starts them (--node-rank on each machine).
        logging.getLogger("deepwell.worker").error(
            "a joining worker is one engine; run data-parallel ranks with "
            "`deepwell serve --data-parallel-size N --nnodes M --node-rank K` on each machine"
        )
        return 2
    port = args.port or "*"
    try:
        config = worker_config(
            args,
            _FIRST_REMOTE_ID + secrets.randbelow(1 << 40),
            f"tcp://{args.host}:{port}",
            args.connect,
            parent_pid=0,
        )
    except ValueError as error:  # settings that do not combine
        logging.getLogger("deepwell.worker").error("%s", error)
        return 2
    logging.getLogger("deepwell.worker").info(
        "engine worker %d joining %s", config.worker_id, args.connect
    )
    worker.main(config)
    return 0
