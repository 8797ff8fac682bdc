"""Encoder worker: the model's vision tower alone in a process of its own (`deepwell serve
--encoder-workers N`, the E of DeepInfer's EPD split): images in, span embeddings out.

Started as an engine worker is (`worker.main` picks this loop by the config's role), with
the same heartbeats; the front end hands the embeddings to the prefill worker inside the
request, whose engine then reads them instead of running its own tower.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import zmq

from deepwell.engine.device import resolve_device
from deepwell.engine.encoder_cache import EncoderCache, to_image_embedding
from deepwell.engine.models.registry import build_image_encoder
from deepwell.engine.stats import EngineStats
from deepwell.serve.images.grid import VisionSpec
from deepwell.serve.inbox import waiting_messages
from deepwell.serve.messages import (
    AbortRequest,
    EncodeImages,
    ImagesEncoded,
    ModelInfo,
    Shutdown,
    WorkerConfig,
    WorkerReady,
    encode_message,
)

# While idle the worker wakes this often to notice a dead parent.
IDLE_POLL_MS = 200


class ImageEncoderWorker:
    """The checkpoint's vision tower, its outputs cached by image content hash (a repeated
    image is encoded once per worker)."""

    def __init__(self, config: WorkerConfig) -> None:
        args = config.engine
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self._args = args
        device = resolve_device(args.device)
        encoder = build_image_encoder(args.model, args.torch_dtype).to(device)
        self.cache = EncoderCache(encoder)
        self._config = json.loads((Path(args.model) / "config.json").read_text())

    def encode(self, worker_id: int, message: EncodeImages) -> ImagesEncoded:
        try:
            embeddings = [
                to_image_embedding(image.content_hash, self.cache.embeddings(image))
                for image in message.images
            ]
        except (RuntimeError, ValueError) as error:  # pixels that do not fit their grid
            return ImagesEncoded(worker_id, message.request_id, [], f"image encoder: {error}")
        return ImagesEncoded(worker_id, message.request_id, embeddings)

    def model_info(self) -> ModelInfo:
        """What it runs; the front end takes the language model's facts from the engine
        workers, so those fields stay empty here."""
        choice = self._args.dtype_choice
        return ModelInfo(
            name=Path(self._args.model).name,
            architecture=(self._config.get("architectures") or [""])[0],
            context_limit=0,
            tokenizer_json="",
            chat_template=None,
            eos_token_ids=[],
            dtype=choice.dtype,
            requested_dtype=choice.requested,
            dtype_reason=choice.reason,
            vision=VisionSpec.from_config(self._config),
        )

    def close(self) -> None:
        """Nothing to write out: embeddings live only as long as the process."""


def serve_encoder(
    encoder: ImageEncoderWorker,
    worker_id: int,
    inbox: zmq.Socket,
    outbox: zmq.Socket,
    parent_pid: int | None = None,
    inbox_address: str = "",
) -> Shutdown | None:
    """Encode requests' images until a `Shutdown` arrives (returned) or the parent is gone.

    Every waiting frame is read before encoding, so a request aborted while queued is
    skipped."""
    idle = EngineStats(0, 0, 0, 0)
    outbox.send(encode_message(WorkerReady(worker_id, encoder.model_info(), idle, inbox_address)))
    while True:
        inbox.poll(IDLE_POLL_MS)
        queued: list[EncodeImages] = []
        aborted: set[str] = set()
        for message in waiting_messages(inbox):
            if isinstance(message, Shutdown):
                return message
            if isinstance(message, EncodeImages):
                queued.append(message)
            elif isinstance(message, AbortRequest):
                aborted.update(message.request_ids)
            else:
                raise TypeError(f"encoder worker cannot handle {type(message).__name__}")
        if parent_pid is not None and os.getppid() != parent_pid:
            return None
        for message in queued:
            if message.request_id not in aborted:
                outbox.send(encode_message(encoder.encode(worker_id, message)))
