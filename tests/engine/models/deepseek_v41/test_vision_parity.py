"""DeepSeek-V4.1 with images in the engine against nemo-automodel's vision path (fp32).

A tiny checkpoint with a vision tower (`write_tiny_checkpoint(vision_config=...)`); the
oracle loads the same tensors through nemo's adapter and runs its full forward with
pixel_values, image grids and vision token types. Two images of different aspect ratios
(a 7x10 and an 8x5 patch grid: 3x4 and 3x2 merged cells, both padded) sit in one prompt.
"""

import dataclasses

import numpy as np
import pytest
import torch
from oracles.deepseek_v41_nemo import build_oracle, oracle_image_logits

from deepwell.engine import LLM, EngineArgs, EngineCore, InvalidRequestError, SamplingParams
from deepwell.engine.models.deepseek_v41 import vision
from deepwell.engine.models.deepseek_v41.engram import Engram
from deepwell.engine.models.deepseek_v41.writer import TINY_VISION_CONFIG, write_tiny_checkpoint
from deepwell.engine.models.loader import load_checkpoint
from deepwell.engine.multimodal import ImageInput, image_span_length, image_token_kinds
from deepwell.engine.request import Request
from deepwell.engine.scheduler import ScheduledChunk

ATOL = 1e-5
RATIO = TINY_VISION_CONFIG["downsample_ratio"]
PATCH = TINY_VISION_CONFIG["patch_size"]
WIDE, TALL = (7, 10), (8, 5)
# Chunk sizes that cut the image spans at their start, inside a row and at their end.
CHUNKS = (4, 3, 9, 1, 6, 17, 2, 5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v41_vision")
    return write_tiny_checkpoint(path, vision_config=TINY_VISION_CONFIG, keep_weights=False)


@pytest.fixture(scope="module")
def oracle(checkpoint):
    loaded = load_checkpoint(str(checkpoint.path))
    vision_config = dict(loaded.hf_config["vision_config"])
    vision_config.pop("model_type")
    return build_oracle(
        dict(loaded.hf_config["text_config"], dtype="float32"),
        loaded.tokenizer,
        loaded.tensors,
        quantize_cache=False,
        vision_config=vision_config,
        image_token_id=loaded.hf_config["image_token_id"],
    )


def engine_args(checkpoint, **kwargs) -> EngineArgs:
    defaults = dict(
        model=str(checkpoint.path),
        dtype="float32",
        quantize_kv_cache=False,
        max_model_len=512,
        block_size=16,
        memory_gib=0.5,
    )
    return EngineArgs(**(defaults | kwargs))


@pytest.fixture(scope="module")
def core(checkpoint):
    return EngineCore(engine_args(checkpoint))


def make_image(grid: tuple[int, int], seed: int, offset: int) -> ImageInput:
    rows, cols = grid
    pixels = np.random.default_rng(seed).uniform(-1, 1, (rows * cols, 3, PATCH, PATCH))
    return ImageInput(f"image-{seed}", grid, pixels.astype(np.float32), offset)


def image_prompt(
    image_token_id: int, grids, text_lengths, seed: int = 0
) -> tuple[list[int], list[ImageInput]]:
    """Text, an image, text, ...: len(text_lengths) == len(grids) + 1."""
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    images = []
    for index, length in enumerate(text_lengths):
        ids += torch.randint(3, 256, (length,), generator=generator).tolist()
        if index < len(grids):
            images.append(make_image(grids[index], seed * 10 + index, len(ids)))
            ids += [image_token_id] * image_span_length(grids[index], RATIO)
    return ids, images


def reference_logits(oracle, ids: list[int], images: list[ImageInput]) -> torch.Tensor:
    """[S, V]: nemo's forward over the prompt, its pixels rounded to bf16 as its processor."""
    types = torch.full((1, len(ids)), -1, dtype=torch.long)
    for image in images:
        kinds = torch.tensor(image_token_kinds(image.grid, RATIO))
        types[0, image.offset : image.offset + kinds.numel()] = kinds
    pixels = torch.cat([torch.from_numpy(i.pixel_values).to(torch.bfloat16) for i in images])
    grids = torch.tensor([i.grid for i in images], dtype=torch.long)
    return oracle_image_logits(oracle, torch.tensor([ids]), pixels, grids, types)[0]


class ImageStepDriver:
    """Runs the engine's runner and model on hand-made steps over image prompts and
    returns every row's logits (disjoint blocks and slots per prompt)."""

    def __init__(self, core: EngineCore, prompts) -> None:
        self.core = core
        ratio = core.runner.encoder_cache._encode.downsample_ratio
        bs = core.kv.block_size
        blocks = -(-max(len(ids) for ids, _ in prompts) // bs)
        self.requests = []
        for index, (ids, images) in enumerate(prompts):
            request = Request(str(index), ids, SamplingParams(), frozenset(), torch.Generator())
            request.images = tuple(images)
            request.image_spans = tuple(
                (i.offset, i.offset + i.span_length(ratio), i.content_hash) for i in images
            )
            request.block_ids = list(range(index * blocks, (index + 1) * blocks))
            request.slot = index
            self.requests.append(request)

    def step(self, chunks: list[tuple[int, int, int]]) -> torch.Tensor:
        """chunks: (prompt, start, rows) → [rows, vocab] logits."""
        runner = self.core.runner
        scheduled = [
            ScheduledChunk(self.requests[index], start, rows, completes=False)
            for index, start, rows in chunks
        ]
        rows, meta = runner._prepare(scheduled, 0)
        with torch.inference_mode():
            runner.fill_image_embeddings(meta)
            hidden = runner.model(
                torch.tensor(rows.input_ids), torch.tensor(rows.positions), meta, runner.kv_cache
            )
            return runner.model.compute_logits(hidden)


def image_token_id(checkpoint) -> int:
    return checkpoint.config["image_token_id"]


def test_one_image_in_one_step_matches_the_reference(core, oracle, checkpoint):
    ids, images = image_prompt(image_token_id(checkpoint), [WIDE], [5, 6])
    logits = ImageStepDriver(core, [(ids, images)]).step([(0, 0, len(ids))])
    torch.testing.assert_close(logits, reference_logits(oracle, ids, images), rtol=0, atol=ATOL)


def two_image_prompts(checkpoint):
    token = image_token_id(checkpoint)
    return [
        image_prompt(token, [WIDE, TALL], [5, 4, 3], seed=1),
        image_prompt(token, [TALL, WIDE], [2, 7, 6], seed=2),
    ]


def test_two_images_of_different_shapes_whole_and_chunked_match_the_reference(
    core, oracle, checkpoint
):
    """Prompt 0 whole in one step; prompt 1 in chunks that begin and end inside its image
    spans, beside it."""
    (ids0, images0), (ids1, images1) = prompts = two_image_prompts(checkpoint)
    reference = [reference_logits(oracle, ids, images) for ids, images in prompts]
    driver = ImageStepDriver(core, prompts)
    done, step = 0, 0
    while done < len(ids1):
        rows = min(CHUNKS[step % len(CHUNKS)], len(ids1) - done)
        chunks = [(1, done, rows)] + ([(0, 0, len(ids0))] if step == 0 else [])
        logits = driver.step(chunks)
        torch.testing.assert_close(
            logits[:rows], reference[1][done : done + rows], rtol=0, atol=ATOL
        )
        if step == 0:
            torch.testing.assert_close(logits[rows:], reference[0], rtol=0, atol=ATOL)
        done += rows
        step += 1


def check_greedy(oracle, prompt, images, completion) -> None:
    """Every generated token is the reference's greedy choice after its prefix."""
    tokens = completion.token_ids
    logits = reference_logits(oracle, prompt + tokens, images)
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens


def greedy(llm: LLM, prompts, max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.generate(
        prompt_token_ids=[ids for ids, _ in prompts],
        sampling_params=params,
        multi_modal_data=[images for _, images in prompts],
        use_tqdm=False,
    )


def test_32_greedy_tokens_after_two_images_in_chunked_prefill_match_the_reference(
    checkpoint, oracle
):
    # 7-token steps: both prompts' image spans are cut by chunk boundaries.
    llm = LLM(
        **vars(engine_args(checkpoint, max_num_batched_tokens=7, max_num_seqs=2)),
        decode_sequence=False,
    )
    prompts = two_image_prompts(checkpoint)
    for (ids, images), completion in zip(prompts, greedy(llm, prompts, 32), strict=True):
        assert len(completion.token_ids) == 32
        check_greedy(oracle, ids, images, completion)


@pytest.mark.slow
def test_32_greedy_tokens_with_whole_prefill_and_a_repeated_image(checkpoint, oracle):
    llm = LLM(**vars(engine_args(checkpoint)), decode_sequence=False)
    token = image_token_id(checkpoint)
    prompts = two_image_prompts(checkpoint) + [
        image_prompt(token, [TALL, TALL], [9, 1, 4], seed=3),
        image_prompt(token, [WIDE], [30, 20], seed=4),
    ]
    for (ids, images), completion in zip(prompts, greedy(llm, prompts, 32), strict=True):
        check_greedy(oracle, ids, images, completion)


def wrong_delimiters(model, monkeypatch):
    encoder = model.image_encoder
    monkeypatch.setattr(encoder, "image_start", encoder.image_end)


def one_dimensional_rope(model, monkeypatch):
    right = vision.grid_rotation
    monkeypatch.setattr(
        vision, "grid_rotation", lambda r, c, d, t, device: right(1, r * c, d, t, device)
    )


def patch_major_downsample(model, monkeypatch):
    def forward(self, states, rows, cols):
        r = self.ratio
        cell_rows, cell_cols = -(-rows // r), -(-cols // r)
        grid = states.view(rows, cols, -1).permute(2, 0, 1)
        grid = torch.nn.functional.pad(grid, (0, cell_cols * r - cols, 0, cell_rows * r - rows))
        cells = grid.view(grid.shape[0], cell_rows, r, cell_cols, r).permute(1, 3, 2, 4, 0)
        merged = cells.reshape(cell_rows * cell_cols, -1)
        return self.w2(torch.nn.functional.gelu(self.w1(merged)))

    monkeypatch.setattr(vision.Aligner, "forward", forward)


def text_routing_for_images(model, monkeypatch):
    for layer in model.layers:
        monkeypatch.setattr(layer.ffn, "gate_bias_vl", layer.ffn.gate_bias)


def engram_reads_image_rows(model, monkeypatch):
    right = Engram.forward
    monkeypatch.setattr(Engram, "forward", lambda self, s, rows, _: right(self, s, rows))


@pytest.mark.parametrize(
    "mistake",
    [
        wrong_delimiters,
        one_dimensional_rope,
        patch_major_downsample,
        text_routing_for_images,
        engram_reads_image_rows,
    ],
)
def test_the_parity_check_sees_each_vision_detail(mistake, checkpoint, oracle, monkeypatch):
    """Each detail the reference has, done wrong, moves the logits far past ATOL."""
    core = EngineCore(engine_args(checkpoint))
    mistake(core.runner.model, monkeypatch)
    ids, images = image_prompt(image_token_id(checkpoint), [WIDE, TALL], [5, 4, 3], seed=5)
    logits = ImageStepDriver(core, [(ids, images)]).step([(0, 0, len(ids))])
    worst = (logits - reference_logits(oracle, ids, images)).abs().max().item()
    print(f"{mistake.__name__}: max |logit error| {worst:.3g}")
    assert worst > 100 * ATOL, worst


def test_a_repeated_image_is_encoded_once(checkpoint):
    llm = LLM(**vars(engine_args(checkpoint)), decode_sequence=False)
    token = image_token_id(checkpoint)
    first = image_prompt(token, [WIDE], [5, 6], seed=6)
    # The same image at another place of another prompt.
    ids, (elsewhere,) = image_prompt(token, [WIDE], [9, 2], seed=7)
    again = (ids, [dataclasses.replace(first[1][0], offset=elsewhere.offset)])
    greedy(llm, [first], 2)
    greedy(llm, [again], 2)
    cache = llm.core.runner.encoder_cache
    assert (cache.misses, len(cache)) == (1, 1)


def test_prompts_differing_only_in_their_image_share_no_blocks(checkpoint):
    llm = LLM(**vars(engine_args(checkpoint, enable_prefix_caching=True)), decode_sequence=False)
    token = image_token_id(checkpoint)
    # 67 tokens, the image at [20, 37): a hit is the 4 full blocks, where the first
    # prompt's ring snapshot is (V4.1 resumes only at a snapshot).
    ids, (image,) = image_prompt(token, [WIDE], [20, 30], seed=8)
    other = make_image(WIDE, seed=9, offset=image.offset)
    runs = [[image], [other], [image]]
    cached = []
    for images in runs:
        params = SamplingParams(max_tokens=1, temperature=0)
        llm.generate(
            prompt_token_ids=[ids],
            sampling_params=params,
            multi_modal_data=[images],
            use_tqdm=False,
        )
        cached.append(llm.core.kv.counters.hit_tokens)
    hits = [b - a for a, b in zip([0] + cached, cached, strict=False)]
    # The same token ids both times: only the image's hash keeps the second from a hit.
    assert hits == [0, 0, 64]


def test_an_image_to_a_checkpoint_without_a_vision_tower_is_refused_by_name(tmp_path):
    text_only = write_tiny_checkpoint(tmp_path, keep_weights=False)
    llm = LLM(**vars(engine_args(text_only)), decode_sequence=False)
    ids, images = image_prompt(text_only.config["image_token_id"], [WIDE], [3, 3])
    with pytest.raises(InvalidRequestError, match="image 0.*no vision tower"):
        greedy(llm, [(ids, images)], 1)


def test_an_image_whose_span_does_not_hold_image_tokens_is_refused(checkpoint, core):
    ids, images = image_prompt(image_token_id(checkpoint), [WIDE, TALL], [3, 2, 3])
    ids[images[1].offset + 4] = 7
    with pytest.raises(InvalidRequestError, match="image 1: prompt position"):
        core.validate(ids, SamplingParams(), images)


def test_batch_invariant_mode_with_images_gives_the_reference_tokens(checkpoint, oracle):
    # Its steps pad to whole row tiles: the image-row mask is padded with them.
    args = engine_args(checkpoint, batch_invariant=True, max_num_batched_tokens=64)
    prompts = two_image_prompts(checkpoint)
    for (ids, images), completion in zip(
        prompts, greedy(LLM(**vars(args), decode_sequence=False), prompts, 8), strict=True
    ):
        check_greedy(oracle, ids, images, completion)


def test_bfloat16_with_images_stays_close_to_the_float32_reference(checkpoint, oracle):
    core = EngineCore(engine_args(checkpoint, dtype="bfloat16"))
    prompts = two_image_prompts(checkpoint)
    logits = ImageStepDriver(core, prompts).step(
        [(0, 0, len(prompts[0][0])), (1, 0, len(prompts[1][0]))]
    )
    reference = torch.cat([reference_logits(oracle, ids, images) for ids, images in prompts])
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    cosines = torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
    worst, mean = cosines.min().item(), cosines.mean().item()
    print(
        f"bf16 vs float32 with images: agreement {agreement:.3f}, cosine mean {mean:.5f} worst {worst:.5f}"
    )
    # Measured: agreement 1.000, cosine mean 0.99993, worst 0.99697; the text model's
    # bounds (test_parity.py) apply.
    assert agreement >= 0.95 and mean > 0.995 and worst > 0.965, (agreement, mean, worst)
