"""Images through every door of a real `deepwell serve --mock` (which checks and preprocesses
images as DeepSeek-V4.1-Flash would), with the official SDKs: data URLs, base64 blocks,
remote URLs from a loopback HTTP server, local files, and each bad input a 400 in the
dialect's shape after which the next request is served."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import zlib

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from servers import start_server

LIMIT = 2


def png(width: int = 40, height: int = 30, fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that says it is `width` x `height` (its pixels never decode)."""
    out = io.BytesIO()
    Image.new("1", (1, 1)).save(out, "PNG")
    data = bytearray(out.getvalue())
    header = data[12:29]
    header[4:12] = struct.pack(">II", width, height)
    data[12:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(header)))
    return bytes(data)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            body = png()
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        port = self.server.server_address[1]
        targets = {
            "/hop.png": f"http://127.0.0.1:{port}/cat.png",
            "/away.png": f"http://localhost:{port}/cat.png",
        }
        self.send_response(302 if self.path in targets else 404)
        if self.path in targets:
            self.send_header("Location", targets[self.path])
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png())
    return folder


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory, media_dir):
    server = start_server(
        tmp_path_factory.mktemp("vision"),
        "--mock",
        "--allowed-media-domains",
        "127.0.0.1",
        "--allowed-local-media-path",
        str(media_dir),
        "--limit-mm-per-prompt",
        f"image={LIMIT}",
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def openai_client(vision_server):
    return openai.OpenAI(base_url=f"{vision_server.base_url}/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(vision_server):
    return anthropic.Anthropic(base_url=vision_server.base_url, api_key="-", max_retries=0)


def chat(client: openai.OpenAI, *urls: str, model: str = "DeepSeek-V4.1-Flash"):
    parts = [{"type": "text", "text": "What is this?"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": parts}], max_tokens=8
    )


def test_chat_image_url_parts_are_served(openai_client, image_host, media_dir):
    for url in (
        data_url(png()),
        f"{image_host}/cat.png",
        f"{image_host}/hop.png",
        f"file://{media_dir}/cat.png",
    ):
        reply = chat(openai_client, url).parse()
        assert reply.choices[0].message.content == "Hello world!", url


def test_responses_input_image_is_served(openai_client):
    response = openai_client.responses.create(
        model="DeepSeek-V4.1-Flash",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe it."},
                    {"type": "input_image", "image_url": data_url(png()), "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=8,
    )
    assert response.output_text == "Hello world!"


def test_messages_image_blocks_are_served(anthropic_client, image_host):
    sources = [
        {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png()).decode()},
        {"type": "url", "url": f"{image_host}/cat.png"},
    ]
    for source in sources:
        message = anthropic_client.messages.create(
            model="DeepSeek-V4.1-Flash",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "image", "source": source}]}],
        )
        assert message.content[-1].text == "Hello world!"


@pytest.mark.parametrize(
    "url,says",
    [
        (data_url(b"\x89PNG\r\n\x1a\n but then nothing"), "not an image"),
        (data_url(png()[:80]), "corrupt"),
        (data_url(png_header(0, 0)), "not an image"),
        (data_url(png_header(10_000, 5_000)), "--max-image-pixels"),
        (data_url(png(fmt="BMP")), "BMP"),
        ("http://images.example/cat.png", "--allowed-media-domains"),
        ("AWAY", "localhost"),
        ("file:///etc/hostname", "not under the allowed local media path"),
    ],
)
def test_bad_images_are_refused_in_the_openai_shape(openai_client, image_host, url, says):
    url = f"{image_host}/away.png" if url == "AWAY" else url
    with pytest.raises(openai.BadRequestError) as refused:
        chat(openai_client, url)
    message = refused.value.body["message"]
    assert says in message and message.startswith("image 1 (messages[0]): "), message
    assert chat(openai_client, data_url(png())).parse().choices[0].message.content


def test_too_many_images_are_refused_naming_the_first_beyond_the_limit(openai_client):
    urls = [data_url(png(8 + i)) for i in range(LIMIT + 1)]
    with pytest.raises(openai.BadRequestError, match="--limit-mm-per-prompt") as refused:
        chat(openai_client, *urls)
    assert refused.value.body["message"].startswith(f"image {LIMIT + 1} (messages[0]): ")
    assert chat(openai_client, *urls[:LIMIT]).parse().choices[0].message.content


def test_bad_image_is_refused_in_the_anthropic_shape(anthropic_client):
    corrupt = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgoAAAAA"}
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_client.messages.create(
            model="DeepSeek-V4.1-Flash",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "image", "source": corrupt}]}],
        )
    assert refused.value.body["type"] == "error"
    assert "not an image" in refused.value.body["error"]["message"]


def test_remote_and_local_images_are_off_unless_allowed(mock_server):
    client = openai.OpenAI(base_url=f"{mock_server.base_url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--allowed-media-domains 127.0.0.1"):
        chat(client, "http://127.0.0.1:9/cat.png")
    with pytest.raises(openai.BadRequestError, match="--allowed-local-media-path"):
        chat(client, "file:///tmp/cat.png")


def test_text_only_v4_pro_answers_with_a_header_saying_the_image_was_not_seen(openai_client):
    reply = chat(openai_client, data_url(png()), data_url(png(9)), model="DeepSeek-V4-Pro")
    assert reply.headers["x-deepwell-images-not-seen"] == "2"
    assert reply.parse().choices[0].message.content == "Hello world!"
    seen = chat(openai_client, data_url(png()))
    assert "x-deepwell-images-not-seen" not in seen.headers


def test_embedded_model_refuses_an_image_naming_its_part(model_server):
    body = {
        "model": model_server.model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": data_url(png())}},
                ],
            }
        ],
        "max_tokens": 4,
    }
    refused = httpx.post(f"{model_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["message"].startswith("image 1 (messages[0]): the model ")
    assert "does not take images" in error["message"]
    body["messages"][0]["content"] = "Say hi."
    assert httpx.post(
        f"{model_server.base_url}/v1/chat/completions", json=body, timeout=60
    ).is_success


def test_v41_checkpoint_without_vision_weights_refuses_an_image(v41_server):
    client = anthropic.Anthropic(base_url=v41_server.base_url, api_key="-", max_retries=0)
    image = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png()).decode()}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model=v41_server.model,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": image}]}],
        )
    message = refused.value.body["error"]["message"]
    assert message.startswith("image 1 (messages.0.content[0]): the model "), message
    assert "no vision tower" in message
    reply = client.messages.create(
        model=v41_server.model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
    )
    assert reply.stop_reason in ("end_turn", "max_tokens")


def test_bad_image_is_refused_in_the_responses_shape(openai_client):
    def describe(url: str):
        return openai_client.responses.create(
            model="DeepSeek-V4.1-Flash",
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],
            max_output_tokens=8,
        )

    with pytest.raises(openai.BadRequestError) as refused:
        describe(data_url(png_header(10_000, 5_000)))
    assert "--max-image-pixels" in refused.value.body["message"]
    assert refused.value.body["param"], refused.value.body
    assert describe(data_url(png())).output_text == "Hello world!"


def test_tokenize_refuses_an_image_the_model_cannot_see(model_server):
    part = {"type": "image_url", "image_url": {"url": data_url(png())}}
    body = {"messages": [{"role": "user", "content": [part]}]}
    refused = httpx.post(f"{model_server.base_url}/tokenize", json=body, timeout=60)
    assert refused.status_code == 400
    assert "does not take images" in refused.json()["error"]["message"]
