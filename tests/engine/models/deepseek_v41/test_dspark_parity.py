"""DSpark drafts in the engine against nemo-automodel's draft backbone (spec §3.6, §1.5).

The engine prefills a prompt with DSpark on (the target fills the stages' context rings)
and drafts one block after the token it sampled; nemo's target gives the features at
every prompt position (hooks on the attention mHC inputs of `dspark_target_layer_ids`),
and nemo's backbone runs the same block on them, teacher-forced with the engine's drafted
tokens. Float32, cache quantisation off on both sides: the draft distributions, the greedy
tokens and the confidences (on the pre-norm state, the release's input) must agree.
"""

import pytest
import torch

# The oracle module first: it turns Dynamo off before nemo's compiled expert activation loads.
from oracles.deepseek_v41_nemo import build_oracle, nemo_dspark

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.engine.models.loader import load_checkpoint

from .nemo_reference import nemo_draft

ATOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_checkpoint(str(checkpoint))


@pytest.fixture(scope="module")
def oracles(checkpoint, loaded):
    text_config = dict(loaded.hf_config["text_config"], dtype="float32")
    target = build_oracle(text_config, loaded.tokenizer, loaded.tensors, quantize_cache=False)
    draft = nemo_draft(checkpoint)
    drafted = {
        name: t.clone()
        for name, t in loaded.tensors.items()
        if name.startswith(("mtp.", "embed.", "head."))
    }
    draft.load_state_dict(draft.state_dict_adapter.from_hf(drafted), strict=True)
    return target, draft.eval()


@pytest.fixture(scope="module")
def core(checkpoint):
    return EngineCore(
        EngineArgs(
            model=str(checkpoint),
            dtype="float32",
            quantize_kv_cache=False,
            max_model_len=256,
            block_size=16,
            memory_gib=0.5,
            speculative_method="dspark",
            async_scheduling=False,
        )
    )


def target_features(target, ids: list[int], layers: list[int]) -> torch.Tensor:
    """[1, len(ids), layers·hidden]: per position the stream mean entering each layer's attention."""
    captured = []
    hooks = [
        module.register_forward_pre_hook(lambda _, args: captured.append(args[0].mean(dim=2)))
        for module in target.get_dspark_target_feature_modules(layers)
    ]
    with torch.no_grad():
        target(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.cat(captured, dim=-1)


def nemo_block(draft, features, anchor_token, anchor, previous, monkeypatch):
    """nemo's draft logits [block, vocab], pre-norm confidence logits [block]."""
    monkeypatch.setattr(nemo_dspark, "quantize_cache", lambda values, **_: values)
    config = draft.config
    anchors = torch.tensor([[anchor]])
    ids = torch.full((1, config.dspark_block_size), config.dspark_noise_token_id)
    ids[0, 0] = anchor_token
    pre_norm = []
    hook = draft.mtp[-1].norm.register_forward_pre_hook(lambda _, args: pre_norm.append(args[0]))
    with torch.no_grad():
        out = nemo_dspark.DeepseekV41DSparkBackbone.forward(
            draft,
            draft.embed_tokens(ids),
            features,
            position_ids=draft.build_position_ids(anchors, features.shape[1]),
            attention_mask=draft.build_attention_mask(
                anchors, torch.tensor([[True]]), features.shape[1], torch.float32
            ),
            previous_token_ids=torch.tensor([previous]),
        )
        logits = draft.compute_logits(out.normalized_hidden_states) + out.transition_logits
        embedding = draft.mtp[-1].markov_head.embed(torch.tensor([previous]))
        confidence = draft.mtp[-1].confidence_head(pre_norm[0], embedding)
    hook.remove()
    return logits[0], confidence[0]


def draft_after_prefill(core, prompt, request_id, **params):
    core.add_request(request_id, prompt, SamplingParams(max_tokens=8, **params))
    while core.requests[request_id].num_output_tokens == 0:
        core.step()
    request = core.requests[request_id]
    room = core.speculator.num_speculative_tokens
    (draft,) = core.speculator.drafter.propose([request], [room])
    token_ids = list(request.token_ids)
    core.abort(request_id)
    core.step()
    return token_ids, draft


@pytest.mark.parametrize("length", [5, 21], ids=["context-shorter-than-window", "full-window"])
def test_draft_distributions_tokens_and_confidence_match_nemo(
    core, oracles, loaded, length, monkeypatch
):
    target, draft = oracles
    config = loaded.hf_config["text_config"]
    prompt = torch.randint(3, 250, (length,), generator=torch.Generator().manual_seed(length))
    token_ids, sampled = draft_after_prefill(core, prompt.tolist(), "s", temperature=1.0, seed=3)
    greedy_ids, greedy = draft_after_prefill(core, prompt.tolist(), "g", temperature=0)
    anchor = len(token_ids) - 1
    features = target_features(target, token_ids[:anchor], config["dspark_target_layer_ids"])
    width = len(sampled.tokens)
    assert width == config["dspark_block_size"]

    previous = [token_ids[-1], *sampled.tokens[:-1]]
    logits, confidence = nemo_block(draft, features, token_ids[-1], anchor, previous, monkeypatch)
    torch.testing.assert_close(sampled.probs, logits.softmax(-1), atol=ATOL, rtol=0)
    survival = torch.sigmoid(confidence).cumprod(0)
    torch.testing.assert_close(torch.tensor(sampled.survival), survival, atol=ATOL, rtol=0)

    # Same prompt, so the same context; the anchor is the greedy request's own token.
    previous = [greedy_ids[-1], *greedy.tokens[:-1]]
    logits, _ = nemo_block(draft, features, greedy_ids[-1], anchor, previous, monkeypatch)
    assert greedy.tokens == logits.argmax(-1).tolist()
    assert greedy.probs is None
