"""Images of one request → `PreparedImage`s: bytes read in the calling thread, decoding and
resizing in a process pool (DeepInfer's multimodal pool), so neither the event loop nor the
GIL of the HTTP process carries the pixel work.

DEEPWELL_USE_MULTIMODAL_POOL (default on) and DEEPWELL_MULTIMODAL_POOL_SIZE (processes).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

from deepwell.recipe.conversation import ImageSource
from deepwell.serve.images.grid import VisionSpec
from deepwell.serve.images.media import MediaAccess, image_bytes
from deepwell.serve.images.pixels import ImageRejected, PixelLimits, PreparedImage, prepare_image
from deepwell.serve.settings import POOL_SIZE_ENV, USE_POOL_ENV
from deepwell.settings import environment

DEFAULT_POOL_SIZE = 2
MAX_POOL_SIZE = 64


def image_part(index: int, source: ImageSource) -> str:
    """How an error names the `index`-th image of a request: its ordinal and the part of
    the request holding it (the recipe's path, as the reference writes it)."""
    path = source.path.lstrip(".")
    return f"image {index + 1} ({path})" if path else f"image {index + 1}"


class ImageFault(ValueError):
    """An image of a request that cannot be used; `part` names it (image_part)."""

    def __init__(self, part: str, path: str, reason: str) -> None:
        super().__init__(f"{part}: {reason}")
        self.path = path


@dataclass(frozen=True)
class PoolConfig:
    """Whether the pool runs, and how many processes it may start."""

    enabled: bool = True
    size: int = DEFAULT_POOL_SIZE

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> PoolConfig:
        enabled = environment.read(USE_POOL_ENV, environ)
        size = environment.read(POOL_SIZE_ENV, environ)
        if size is None:
            size = min(DEFAULT_POOL_SIZE, os.cpu_count() or 1)
        if not 1 <= size <= MAX_POOL_SIZE:
            raise ValueError(f"{POOL_SIZE_ENV} must be in [1, {MAX_POOL_SIZE}], got {size}")
        return cls(enabled=True if enabled is None else enabled, size=size)


class ImagePreprocessor:
    """Prepares a request's images for one vision spec; `close` stops the pool's processes."""

    def __init__(
        self,
        spec: VisionSpec,
        limits: PixelLimits,
        access: MediaAccess,
        pool: PoolConfig,
    ) -> None:
        self.spec = spec
        self.limits = limits
        self.access = access
        # Started on first use, with fresh interpreters: the HTTP process runs threads
        # (uvicorn, ZeroMQ) that a forked child must not inherit.
        self._pool = (
            ProcessPoolExecutor(pool.size, mp_context=multiprocessing.get_context("spawn"))
            if pool.enabled
            else None
        )

    def prepare(self, sources: Sequence[ImageSource]) -> list[PreparedImage]:
        """Every image of a request, in order; ImageFault names the first bad one. Blocks:
        call it off the event loop."""
        payloads = []
        for index, source in enumerate(sources):
            try:
                payloads.append(image_bytes(source, self.access))
            except ImageRejected as error:
                raise ImageFault(image_part(index, source), source.path, str(error)) from None
        submit = _run_now if self._pool is None else self._pool.submit
        futures = [submit(prepare_image, data, self.spec, self.limits) for data in payloads]
        prepared = []
        for index, (source, future) in enumerate(zip(sources, futures, strict=True)):
            try:
                prepared.append(future.result())
            except ImageRejected as error:
                for pending in futures:
                    pending.cancel()
                raise ImageFault(image_part(index, source), source.path, str(error)) from None
        return prepared

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _run_now(prepare: Callable[..., PreparedImage], *args: object) -> Future:
    """`prepare(*args)` in this thread, as a finished future (the pool switched off)."""
    future: Future = Future()
    try:
        future.set_result(prepare(*args))
    except ImageRejected as error:
        future.set_exception(error)
    return future
