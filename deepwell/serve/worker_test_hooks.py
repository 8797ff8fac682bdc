"""Test hooks of the engine worker: a request that crashes its worker (os._exit, as a
segfault would) or makes its step raise, picked by a marker in its prompt.

Off unless a test sets DEEPWELL_TEST_WORKER_EXIT_ON_PROMPT or
DEEPWELL_TEST_WORKER_RAISE_ON_PROMPT (settings/environment.py); off, the worker runs its
engine unwrapped, so service pays nothing for them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from deepwell.serve.messages import GenerateRequest
from deepwell.settings import environment

if TYPE_CHECKING:
    from deepwell.engine.outputs import RequestOutput
    from deepwell.serve.worker import EngineCoreAdapter

logger = logging.getLogger("deepwell.worker")
# The exit status of a worker a poisoned prompt crashed.
POISONED_EXIT_STATUS = 70


def with_test_hooks(
    engine: EngineCoreAdapter, environ: Mapping[str, str] = os.environ
) -> EngineCoreAdapter | PoisonedPrompts:
    """`engine` itself, or wrapped in the hooks the environment asks for."""
    exit_on = environment.read(environment.WORKER_EXIT_ON_PROMPT_ENV, environ)
    raise_on = environment.read(environment.WORKER_RAISE_ON_PROMPT_ENV, environ)
    if not exit_on and not raise_on:
        return engine
    logger.warning("test hooks on: exit on %r, raise on %r", exit_on, raise_on)
    return PoisonedPrompts(engine, exit_on, raise_on)


class PoisonedPrompts:
    """The engine, but a request whose prompt holds `exit_on` ends the process as it is
    taken in, and one whose prompt holds `raise_on` makes every step raise while it is in
    the engine."""

    def __init__(self, engine: EngineCoreAdapter, exit_on: str | None, raise_on: str | None):
        self._engine = engine
        self._exit_on = exit_on
        self._raise_on = raise_on
        self._poisoned: set[str] = set()

    def add_request(self, request: GenerateRequest) -> None:
        text = self._engine.prompt_text(request.prompt_token_ids)
        if self._exit_on and self._exit_on in text:
            os._exit(POISONED_EXIT_STATUS)
        if self._raise_on and self._raise_on in text:
            self._poisoned.add(request.request_id)
        self._engine.add_request(request)

    def step(self) -> list[RequestOutput]:
        if self._poisoned.intersection(self._engine.unfinished_request_ids()):
            raise RuntimeError("test hook: a poisoned request is in this step")
        return self._engine.step()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)
