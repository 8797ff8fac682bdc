"""nemo-automodel 0.7.0's DeepSeek-V4.1 models built from one of our config.json files.

Test-only: its state-dict adapters are the reference for the released names, shapes,
storage dtypes and dequantisation (spec §3.8).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # spec §1.2 item 2; no forward runs here

import contextlib  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.dspark import (  # noqa: E402
    DeepseekV41DSparkModel,
)
from nemo_automodel.components.models.deepseek_v41.model import (  # noqa: E402
    DeepseekV41ForCausalLM,
)
from nemo_automodel.components.models.deepseek_v41.vision import (  # noqa: E402
    DeepseekV41VisionAligner,
    DeepseekV41VisionTransformer,
)
from oracles.deepseek_v41_nemo import CPU_BACKEND  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402


def nemo_config(config_json: dict[str, Any]) -> DeepseekV41Config:
    """Our config.json as nemo reads a released one, switched to float32."""
    config = copy.deepcopy(config_json)
    config.pop("model_type")  # a class attribute in transformers, not an argument
    config["dtype"] = config["text_config"]["dtype"] = "float32"
    return DeepseekV41Config(**config)


def nemo_target(checkpoint_dir: Path) -> DeepseekV41ForCausalLM:
    """The backbone on our config.json and tokenizer.json, nemo-initialised in float32."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint_dir / "tokenizer.json"))
    with _quiet(), torch.random.fork_rng():
        torch.manual_seed(0)
        config = nemo_config(json.loads((checkpoint_dir / "config.json").read_text()))
        model = DeepseekV41ForCausalLM(config, backend=CPU_BACKEND, tokenizer=tokenizer)
        model.initialize_weights(dtype=torch.float32)
    model.state_dict_adapter.dtype = torch.float32  # dequantise to float32, as we do
    return model


def nemo_draft(checkpoint_dir: Path) -> DeepseekV41DSparkModel:
    """The DSpark draft (the `mtp.*` stages) on our config.json, in float32."""
    with _quiet(), torch.random.fork_rng():
        torch.manual_seed(0)
        config = nemo_config(json.loads((checkpoint_dir / "config.json").read_text()))
        model = DeepseekV41DSparkModel(
            config.text_config, backend=CPU_BACKEND, num_anchors=1, enable_confidence_head=True
        )
    model.state_dict_adapter.dtype = torch.float32
    return model


def nemo_vision_shapes(config_json: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Released name → shape of nemo's vision tower, aligner and image markers for a config."""
    with _quiet(), torch.random.fork_rng():
        config = nemo_config(config_json)
        modules = {
            "vision": DeepseekV41VisionTransformer(config),
            "aligner": DeepseekV41VisionAligner(config),
        }
    shapes = {
        f"{prefix}.{name}": tuple(tensor.shape)
        for prefix, module in modules.items()
        for name, tensor in module.state_dict().items()
    }
    # The model registers these beside the two modules (DeepseekV41Model.__init__).
    hidden = config.text_config.hidden_size
    return shapes | {name: (hidden,) for name in ("image_start", "image_end", "image_newline")}


@contextlib.contextmanager
def _quiet():
    # The released config spells it rope_scaling; transformers prefers rope_parameters and
    # says so whenever it builds a config.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`rope_scaling` is deprecated", FutureWarning)
        yield
