"""LLM: the offline facade — load a model, generate for a list of prompts, return completions."""

from collections.abc import Sequence

from tqdm import tqdm

from deepwell.engine.args import EngineArgs
from deepwell.engine.core import EngineCore
from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.multimodal import ImageInput
from deepwell.engine.outputs import Completion
from deepwell.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        """`model`: a .gguf file or a config.json + safetensors directory; None = embedded
        SmolLM2-135M-Instruct. Other keyword arguments are EngineArgs fields."""
        self.core = EngineCore(EngineArgs(model=model, **kwargs))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        multi_modal_data: Sequence[Sequence[ImageInput]] | None = None,
    ) -> list[Completion]:
        """One completion per prompt, in input order. Pass text `prompts` or `prompt_token_ids`;
        `multi_modal_data`: each prompt's images (their spans already in its token ids)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("pass exactly one of prompts and prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = [self.tokenizer.encode(p).ids for p in prompts]
        assert prompt_token_ids is not None
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompt_token_ids)
        if len(sampling_params) != len(prompt_token_ids):
            raise InvalidRequestError(
                f"{len(sampling_params)} sampling params for {len(prompt_token_ids)} prompts"
            )
        if multi_modal_data is None:
            multi_modal_data = [()] * len(prompt_token_ids)
        if len(multi_modal_data) != len(prompt_token_ids):
            raise InvalidRequestError(
                f"multi_modal_data for {len(multi_modal_data)} prompts, not {len(prompt_token_ids)}"
            )
        requests = list(zip(prompt_token_ids, sampling_params, multi_modal_data, strict=True))
        # Validate all first, so a bad prompt fails the call before any work starts.
        for ids, params, images in requests:
            self.core.validate(list(ids), params, images)
        order: list[str] = []
        for ids, params, images in requests:
            request_id = str(self._next_id)
            self._next_id += 1
            self.core.add_request(request_id, list(ids), params, images=images)
            order.append(request_id)
        tokens: dict[str, list[int]] = {i: [] for i in order}
        # The output's text leaves out the stop id that ended it (RequestOutput.stop_token_id).
        text_tokens: dict[str, list[int]] = {i: [] for i in order}
        logprobs: dict[str, list] = {i: [] for i in order}
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
                    seeds[output.request_id] = output.seed
                    if output.finished:
                        finished[output.request_id] = output.finish_reason
                        bar.update(1)
        return [
            Completion(
                request_id=i,
                prompt_token_ids=list(ids),
                token_ids=tokens[i],
                text=self.tokenizer.decode(text_tokens[i]) if self.tokenizer else "",
                finish_reason=finished[i],
                logprobs=logprobs[i],
                seed=seeds[i],
            )
            for i, ids in zip(order, prompt_token_ids, strict=True)
        ]
