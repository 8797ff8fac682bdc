"""Vision benchmark: images per second through the encoder (the tower alone), what one
image's embeddings cost to move between processes, and the TTFT of an image prompt with a
cold and a warm encoder cache, with and without the encoder stage (`--encoder-workers`).

    .venv/bin/python benchmarks/vision.py                  # a tiny vision checkpoint, written here
    .venv/bin/python benchmarks/vision.py --model DIR --images 8 --image-size 640x480

Each part runs in a process of its own: the encoder in a child Python, each server
configuration in its own `deepwell serve`. TTFT runs without prefix caching, so a repeated
image saves its encoding (the encoder cache) and nothing else.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from serve_cluster import start_server

REPO = Path(__file__).resolve().parents[1]
# The released model's largest image span and text width (bf16): the embeddings one image
# hands from the encoder stage to prefill at most.
RELEASED_SPAN, RELEASED_WIDTH = 1024, 4096


def picture(size: tuple[int, int], seed: int) -> bytes:
    width, height = size
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def encoder_throughput(args: argparse.Namespace) -> None:
    """In this (child) process: the tower alone, cold images then the same ones again."""
    import torch

    from deepwell.engine.encoder_cache import EncoderCache
    from deepwell.engine.models.registry import build_image_encoder
    from deepwell.engine.multimodal import ImageInput
    from deepwell.serve.images.grid import VisionSpec
    from deepwell.serve.images.pixels import PixelLimits, prepare_image

    torch.set_num_threads(args.threads)
    config = json.loads((Path(args.model) / "config.json").read_text())
    spec = VisionSpec.from_config(config)
    cache = EncoderCache(build_image_encoder(args.model, getattr(torch, args.dtype)))
    prepared = [
        prepare_image(picture(args.size, seed), spec, PixelLimits()) for seed in range(args.images)
    ]
    images = [
        ImageInput(p.content_hash, (p.grid.vit_height, p.grid.vit_width), p.pixel_values, 0)
        for p in prepared
    ]
    for label in ("cold", "warm"):
        start = time.perf_counter()
        spans = [cache.embeddings(image).shape[0] for image in images]
        seconds = time.perf_counter() - start
        print(
            f"encoder {label}: {len(images) / seconds:8.2f} images/s "
            f"({seconds / len(images) * 1000:.1f} ms each; {prepared[0].grid.num_patches} "
            f"patches, span {spans[0]})",
            flush=True,
        )


def transport(args: argparse.Namespace) -> None:
    """One released-size embedding through the worker transport (msgpack frame over a ZeroMQ
    ipc socket pair, as encoder → front end → prefill does twice) against a file write and
    read (the least a trip through the KV store's directory costs)."""
    import torch
    import zmq

    from deepwell.engine.encoder_cache import from_image_embedding, to_image_embedding
    from deepwell.serve.messages import ImagesEncoded, decode_message, encode_message

    values = torch.randn(RELEASED_SPAN, RELEASED_WIDTH).to(torch.bfloat16)
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="deepwell-vision-") as folder:
        address = f"ipc://{folder}/frames"
        pull = context.socket(zmq.PULL)
        pull.bind(address)
        push = context.socket(zmq.PUSH)
        push.connect(address)
        frame_s, file_s = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            message = ImagesEncoded(0, "r", [to_image_embedding("h", values)])
            push.send(encode_message(message))
            received = decode_message(pull.recv())
            from_image_embedding(received.embeddings[0], torch.device("cpu"))
            frame_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            path = Path(folder) / "embedding.bin"
            path.write_bytes(values.view(torch.int16).numpy().tobytes())
            torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.bfloat16)
            file_s.append(time.perf_counter() - start)
        push.close()
        pull.close()
    context.term()
    size = values.numel() * values.element_size() / 2**20
    print(
        f"transport of a {RELEASED_SPAN}x{RELEASED_WIDTH} bf16 embedding ({size:.0f} MiB): "
        f"frame {statistics.median(frame_s) * 1000:.1f} ms, "
        f"file write+read {statistics.median(file_s) * 1000:.1f} ms (medians of {args.repeats})",
        flush=True,
    )


def first_token_s(base_url: str, model: str, image: bytes) -> float:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    body = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        "max_tokens": 2,
        "temperature": 0,
        "thinking": {"type": "disabled"},
        "stream": True,
    }
    start = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if '"content":"' in line:
                return time.perf_counter() - start
    raise SystemExit("the stream ended without content")


def ttft(args: argparse.Namespace, stage: bool) -> None:
    extra = ["--model", args.model, "--no-enable-prefix-caching", "--dtype", args.dtype]
    extra += ["--encoder-workers", "1"] if stage else []
    server, base_url = start_server(args, extra)
    try:
        model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        first_token_s(base_url, model, picture(args.size, 999))  # warm the kernels
        cold, warm = [], []
        for seed in range(args.images):
            image = picture(args.size, 1000 + seed)
            cold.append(first_token_s(base_url, model, image))
            warm.append(first_token_s(base_url, model, image))
    finally:
        server.terminate()
        server.wait(60)
    label = "with the encoder stage" if stage else "engine encodes itself"
    print(
        f"TTFT {label:24}: cold {statistics.median(cold) * 1000:7.0f} ms, "
        f"warm {statistics.median(warm) * 1000:7.0f} ms (medians of {args.images})",
        flush=True,
    )


def tiny_vision_checkpoint(folder: str) -> str:
    from deepwell.engine.models.deepseek_v41.writer import TINY_VISION_CONFIG, write_tiny_checkpoint

    path = Path(folder) / "deepseek-v4.1-tiny-vision"
    write_tiny_checkpoint(path, vision_config=TINY_VISION_CONFIG, keep_weights=False)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a V4.1 directory with a vision tower (default: tiny)")
    parser.add_argument("--images", type=int, default=4, help="distinct images per part")
    parser.add_argument("--image-size", default="640x480", help="WIDTHxHEIGHT of each image")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10, help="transport repetitions")
    parser.add_argument("--memory-gib", type=float, default=1.0)
    parser.add_argument("--only", choices=("encoder", "transport"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.size = tuple(int(n) for n in args.image_size.split("x"))
    if args.only is not None:
        {"encoder": encoder_throughput, "transport": transport}[args.only](args)
        return
    with tempfile.TemporaryDirectory(prefix="deepwell-vision-") as folder:
        if args.model is None:
            args.model = tiny_vision_checkpoint(folder)
        # The tower and the transport each in a fresh process, as the servers are.
        for part in ("encoder", "transport"):
            command = [sys.executable, __file__, "--only", part, "--model", args.model]
            command += ["--images", str(args.images), "--image-size", args.image_size]
            command += ["--dtype", args.dtype, "--threads", str(args.threads)]
            command += ["--repeats", str(args.repeats)]
            subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        for stage in (False, True):
            ttft(args, stage)


if __name__ == "__main__":
    main()
