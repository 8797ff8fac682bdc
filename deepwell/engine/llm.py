"""LLM: the offline facade with DeepInfer's API (spec/deepinfer.md §1.3): load a model, generate
for a list of prompts, return the decoded strings (or the finished completions), close.

A DeepInfer script runs unchanged after changing its import; deepwell's own EngineArgs names
are accepted too and keep their meaning (engine/deepinfer_args.py maps the keywords).
"""

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tqdm import tqdm

from deepwell.engine.core import EngineCore
from deepwell.engine.deepinfer_args import offline_engine_args
from deepwell.engine.device import resolve_device
from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.multimodal import ImageInput
from deepwell.engine.outputs import Completion
from deepwell.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# Notes already logged in this process: each argument without effect is said once.
_logged: set[str] = set()
# DeepInfer's default, which on the CPU asks for nothing and so is not remarked on.
_GPU_MEMORY_UTILIZATION = 0.9


class LLM:
    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        expert_parallel_size: int = 1,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        decode_sequence: bool = True,
        **kwargs: Any,
    ) -> None:
        """`model`: a .gguf file, a config.json + safetensors directory, or a Hugging Face
        cache directory (`revision` picks its snapshot); None = the embedded
        SmolLM2-135M-Instruct. `tokenizer`: a tokenizer.json (or a directory with one) to use
        in place of the model's. Other keywords: DeepInfer's EngineArgs (docs/engine.md,
        "Offline API") or deepwell's EngineArgs fields. `decode_sequence`: `generate` returns
        strings; False returns `Completion`s."""
        offline = offline_engine_args(
            model,
            tokenizer=tokenizer,
            revision=revision,
            tokenizer_revision=tokenizer_revision,
            expert_parallel_size=expert_parallel_size,
            trust_remote_code=trust_remote_code,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            **kwargs,
        )
        notes = list(offline.notes)
        if gpu_memory_utilization != _GPU_MEMORY_UTILIZATION and (
            resolve_device(offline.engine.device).type == "cpu"
        ):
            notes.append(
                f"gpu_memory_utilization={gpu_memory_utilization} has no effect on the CPU: "
                f"memory_gib={offline.engine.memory_gib} sets the memory budget"
            )
        for note in notes:
            if note not in _logged:
                _logged.add(note)
                logger.warning("LLM: %s", note)
        self.decode_sequence = decode_sequence
        # Before the model loads: a wrong path fails in a moment.
        own_tokenizer = _load_tokenizer(offline.tokenizer) if offline.tokenizer else None
        self.core = EngineCore(offline.engine)
        self._tokenizer = own_tokenizer or self.core.tokenizer
        self._next_id = 0
        self._closed = False

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine's threads and ranks and write queued KV blocks; again is a no-op."""
        if not self._closed:
            self._closed = True
            self.core.close()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        multi_modal_data: Sequence[Sequence[ImageInput] | None] | None = None,
    ) -> list[str] | list[Completion]:
        """One result per prompt, in input order: the decoded output text when the LLM was
        built with `decode_sequence` (the default), else the `Completion`. Pass text
        `prompts` or `prompt_token_ids`; `multi_modal_data`: one entry (None or a list of
        `ImageInput`s, their spans already in the prompt's token ids) per prompt."""
        if self._closed:
            raise InvalidRequestError("this LLM is closed")
        prompt_token_ids = self._prompt_ids(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompt_token_ids)
        if len(sampling_params) != len(prompt_token_ids):
            raise InvalidRequestError(
                f"{len(sampling_params)} sampling params for {len(prompt_token_ids)} prompts"
            )
        images = _images_per_prompt(multi_modal_data, len(prompt_token_ids))
        requests = list(zip(prompt_token_ids, sampling_params, images, strict=True))
        # Validate all first, so a bad prompt fails the call before any work starts.
        for ids, params, images in requests:
            self.core.validate(list(ids), params, images)
        order: list[str] = []
        for ids, params, images in requests:
            request_id = str(self._next_id)
            self._next_id += 1
            self.core.add_request(request_id, list(ids), params, images=images)
            order.append(request_id)
        completions = self._run(order, prompt_token_ids, use_tqdm)
        if self.decode_sequence:
            return [c.text for c in completions]
        return completions

    def _prompt_ids(
        self,
        prompts: str | Sequence[str] | None,
        prompt_token_ids: Sequence[Sequence[int]] | None,
    ) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("pass exactly one of prompts and prompt_token_ids")
        if prompt_token_ids is not None:
            return [list(ids) for ids in prompt_token_ids]
        if isinstance(prompts, str):
            prompts = [prompts]
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; pass prompt_token_ids")
        return [self.tokenizer.encode(p).ids for p in prompts]

    def _run(
        self, order: list[str], prompt_token_ids: list[list[int]], use_tqdm: bool
    ) -> list[Completion]:
        """Step the engine until every request in `order` is finished."""
        tokens: dict[str, list[int]] = {i: [] for i in order}
        # The output's text leaves out the stop id that ended it (RequestOutput.stop_token_id).
        text_tokens: dict[str, list[int]] = {i: [] for i in order}
        logprobs: dict[str, list] = {i: [] for i in order}
        prompt_logprobs: dict[str, list] = {i: [] for i in order}
        sums: dict[str, list[float]] = {i: [] for i in order}
        finished = {}
        seeds: dict[str, int] = {}
        lockstep = self.core.lockstep
        if lockstep is not None:
            # Expert-parallel ranks step together until the whole group is done, so a rank
            # whose own requests are finished still joins its peers' steps.
            lockstep.group_unfinished = True
        with tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(finished) < len(order) or (
                lockstep is not None and lockstep.group_unfinished
            ):
                for output in self.core.step():
                    tokens[output.request_id] += output.new_token_ids
                    text_tokens[output.request_id] += output.text_token_ids
                    logprobs[output.request_id] += output.new_logprobs
                    prompt_logprobs[output.request_id] += output.prompt_logprobs
                    sums[output.request_id] += output.new_sum_smaller_probs
                    seeds[output.request_id] = output.seed
                    if output.finished:
                        finished[output.request_id] = output.finish_reason
                        bar.update(1)
        return [
            Completion(
                request_id=i,
                prompt_token_ids=ids,
                token_ids=tokens[i],
                text=self.tokenizer.decode(text_tokens[i]) if self.tokenizer else "",
                finish_reason=finished[i],
                logprobs=logprobs[i],
                seed=seeds[i],
                prompt_logprobs=prompt_logprobs[i],
                sum_smaller_probs=sums[i],
            )
            for i, ids in zip(order, prompt_token_ids, strict=True)
        ]


def _load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer.json, or the one in a directory."""
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise InvalidRequestError(f"tokenizer {path!r}: no tokenizer.json there")
    return Tokenizer.from_file(str(file))


def _images_per_prompt(
    multi_modal_data: Sequence[Sequence[ImageInput] | None] | None, num_prompts: int
) -> list[tuple[ImageInput, ...]]:
    """Each prompt's images; the engine refuses them, naming the image, on a model without a
    vision tower."""
    if multi_modal_data is None:
        return [()] * num_prompts
    if len(multi_modal_data) != num_prompts:
        raise InvalidRequestError(
            f"multi_modal_data has {len(multi_modal_data)} entries for {num_prompts} prompts; "
            "give one (or None) per prompt",
            "multi_modal_data",
        )
    return [tuple(entry or ()) for entry in multi_modal_data]
