"""AsyncEngine: an asyncio face on EngineCore, one token stream per request.

The step loop runs on its own thread (torch releases the GIL while it computes); callers
on the event loop send commands through a queue and read outputs from per-request queues.
"""

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deepwell.engine.core import EngineCore
from deepwell.engine.outputs import RequestOutput
from deepwell.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cache_class: str


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Add] = {}
        self._thread = threading.Thread(target=self._run, name="deepwell-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_class: str = "chat",
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step until it finishes.

        Bad input raises InvalidRequestError here, before anything is queued. Leaving the
        iteration early (client gone, task cancelled) aborts the request.
        """
        self.core.validate(prompt_token_ids, params)
        outputs: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        command = _Add(request_id, list(prompt_token_ids), params, outputs, loop, cache_class)
        self._commands.put(command)
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort from any thread; takes effect before the next engine step."""
        self._commands.put(_Abort(request_id))

    def close(self) -> None:
        self._commands.put(_Stop())
        self._thread.join()

    def _run(self) -> None:
        while True:
            busy = self.core.has_unfinished()
            try:
                while True:
                    command = self._commands.get(block=not busy)
                    if isinstance(command, _Stop):
                        return
                    self._handle(command)
                    busy = self.core.has_unfinished()
            except queue.Empty:
                pass
            try:
                outputs = self.core.step()
            except Exception as error:  # a failed step must not hang the waiting streams
                self._fail_all(error)
                continue
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, output)

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in self._streams.items():
            self.core.abort(request_id)
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)
        self._streams.clear()
        self.core.step()  # drains the abort outputs nobody is waiting for

    def _handle(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.core.abort(command.request_id)
            return
        try:
            self.core.add_request(
                command.request_id, command.prompt_token_ids, command.params, command.cache_class
            )
        except Exception as error:  # e.g. a duplicate id: the caller's stream gets the error
            command.loop.call_soon_threadsafe(command.outputs.put_nowait, error)
            return
        self._streams[command.request_id] = command
