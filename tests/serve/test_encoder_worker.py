"""The encoder worker's loop and the router's E-then-P path over real ZeroMQ sockets, with a
scripted encoder and a scripted engine (as tests/serve/cluster/test_request_router.py)."""

import asyncio
import threading

import numpy as np
import pytest
import zmq

from deepwell.engine.multimodal import ImageEmbedding, ImageInput
from deepwell.engine.outputs import FinishReason, RequestOutput
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.stats import EngineStats
from deepwell.serve.cluster.assembly import assemble_cluster
from deepwell.serve.cluster.inference_errors import RequestRejected
from deepwell.serve.cluster.worker_pool import WorkerRole
from deepwell.serve.encoder_worker import serve_encoder
from deepwell.serve.images.grid import VisionSpec
from deepwell.serve.messages import GenerateRequest, ImagesEncoded, ModelInfo
from deepwell.serve.worker import serve_engine

IMAGE_TOKEN = 9


class ScriptedEncoder:
    """Each image's embedding is its grid's row count, everywhere; "bad" images fail."""

    def __init__(self):
        self.encoded = []

    def encode(self, worker_id, message):
        self.encoded.append(message.request_id)
        if any(image.content_hash == "bad" for image in message.images):
            return ImagesEncoded(worker_id, message.request_id, [], "image encoder: bad pixels")
        embeddings = [
            ImageEmbedding(image.content_hash, "float32", np.full((4, 2), image.grid[0], "f4"))
            for image in message.images
        ]
        return ImagesEncoded(worker_id, message.request_id, embeddings)

    def model_info(self):
        return ModelInfo("encoder", "none", 0, "", None, [])


class RecordingEngine:
    """Answers every request with one token, keeping the requests it was given."""

    def __init__(self):
        self.received = []
        self.pending = []

    def add_request(self, request):
        self.received.append(request)
        self.pending.append(request.request_id)

    def abort(self, request_ids):
        pass

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        done, self.pending = self.pending, []
        return [RequestOutput(i, [100], [], FinishReason.LENGTH, 6, 1) for i in done]

    def stats(self):
        return EngineStats(len(self.pending), 0, 0, 8)

    def key_changes(self):
        return [], []

    def model_info(self):
        vision = VisionSpec(IMAGE_TOKEN, patch_size=2, downsample_ratio=1)
        return ModelInfo("recording", "none", 4096, "{}", None, [0], vision=vision)


@pytest.fixture
def workers(tmp_path):
    """An engine worker (0) and an encoder worker (1), each in a thread of its own."""
    engine, encoder = RecordingEngine(), ScriptedEncoder()
    context = zmq.Context()
    sockets, threads = [], []
    for index, (loop, served) in enumerate(((serve_engine, engine), (serve_encoder, encoder))):
        inbox = context.socket(zmq.PULL)
        inbox.bind(f"ipc://{tmp_path}/in-{index}")
        outbox = context.socket(zmq.PUSH)
        outbox.connect(f"ipc://{tmp_path}/out")
        sockets += [inbox, outbox]
        threads.append(threading.Thread(target=loop, args=(served, index, inbox, outbox)))
        threads[-1].start()
    inboxes = [f"ipc://{tmp_path}/in-0", f"ipc://{tmp_path}/in-1"]
    yield engine, encoder, f"ipc://{tmp_path}/out", inboxes
    for thread in threads:
        thread.join(timeout=5)
    for socket in sockets:
        socket.close(0)
    context.term()


def image_request(request_id: str, content_hash: str) -> GenerateRequest:
    pixels = np.zeros((3, 3, 2, 2), dtype=np.float32)
    image = ImageInput(content_hash, (3, 1), pixels, 1)
    prompt = [1, *[IMAGE_TOKEN] * 4, 2]
    return GenerateRequest(request_id, prompt, SamplingParams(max_tokens=1), images=(image,))


def run(workers, *requests, views=None):
    engine, encoder, outbox, inboxes = workers

    async def main():
        roles = [WorkerRole.MIXED, WorkerRole.ENCODER]
        cluster = assemble_cluster(outbox, inboxes, roles=roles, block_size=2)
        model = await cluster.pool.start(timeout=10)
        results = []
        for request in requests:
            try:
                results.append([o.new_token_ids async for o in cluster.router.generate(request)])
            except RequestRejected as error:
                results.append(str(error))
        if views is not None:
            views.extend(cluster.router.views())
        await cluster.pool.close()
        return model, results

    return asyncio.run(main())


def test_images_are_encoded_first_and_reach_the_engine_with_their_embeddings(workers):
    engine, encoder, _, _ = workers
    text_only = GenerateRequest("t", [1, 2], SamplingParams(max_tokens=1))
    model, results = run(workers, image_request("i", "cat"), text_only)
    # The engine workers, not the encoder, say what the model is.
    assert model.name == "recording"
    assert results == [[[100]], [[100]]]
    assert encoder.encoded == ["i"]
    with_image, plain = engine.received
    (embedding,) = with_image.image_embeddings
    assert embedding.content_hash == "cat" and embedding.values.tolist() == [[3, 3]] * 4
    assert plain.image_embeddings == ()


def test_an_image_the_encoder_cannot_encode_fails_its_request_alone(workers):
    engine, _, _, _ = workers
    _, results = run(workers, image_request("b", "bad"), image_request("g", "good"))
    assert results == ["image encoder: bad pixels", [[100]]]
    assert [r.request_id for r in engine.received] == ["g"]


def test_the_routers_prefix_keys_tell_prompts_apart_by_their_image(workers):
    # Three 2-token blocks, each reaching into the image's span: a hit only for the same image.
    views = []
    requests = (image_request("1", "cat"), image_request("2", "dog"), image_request("3", "cat"))
    run(workers, *requests, views=views)
    engine_worker = next(view for view in views if view.worker_id == 0)
    assert engine_worker.routed_requests == 3
    assert engine_worker.routed_hit_tokens == 6
