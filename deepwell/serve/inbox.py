"""A worker's inbox read without blocking: every frame waiting now, decoded, so a step (or
an encoding round) starts only after the front end's latest aborts and shutdown are seen."""

from collections.abc import Iterator
from typing import Any

import zmq

from deepwell.serve.messages import decode_message


def waiting_messages(inbox: zmq.Socket) -> Iterator[Any]:
    """The messages waiting on `inbox`, oldest first; ends when none is left."""
    while True:
        try:
            frame = inbox.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        yield decode_message(frame)
