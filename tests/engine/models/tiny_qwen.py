"""Tiny random Qwen2 / Qwen3 checkpoints (seeded), with SmolLM2's tokenizer and a Hermes template.

Written as released Qwen checkpoints are laid out (HF tensor names, config.json,
tokenizer.json, tokenizer_config.json with the chat template), so transformers and deepwell
both load them.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepwell.engine.models.gguf_tokenizer import build_tokenizer
from deepwell.engine.models.loader import embedded_model_path

# Qwen2.5's template, cut to what a Hermes-style tool template needs: a system turn with the
# tool signatures, <tool_call> JSON in assistant turns, tool results as <tool_response>.
HERMES_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
    '\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and'
    " arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_BASE_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    # SmolLM2's <|im_end|>: the turn end of the template below.
    "eos_token_id": 2,
    "bos_token_id": 1,
}


@cache
def smollm2_vocabulary() -> tuple:
    """(model, pre-tokenizer, tokens, merges, token types) from the embedded SmolLM2's GGUF
    metadata; read once, as the reader takes a second over 49k tokens."""
    from deepwell.engine.models.gguf_reader import PlainArrayGGUFReader

    fields = PlainArrayGGUFReader(embedded_model_path()).fields
    return tuple(
        fields[f"tokenizer.ggml.{key}"].contents()
        for key in ("model", "pre", "tokens", "merges", "token_type")
    )


def smollm2_tokenizer():
    """The embedded SmolLM2's tokenizer (no weights loaded)."""
    return build_tokenizer(*smollm2_vocabulary())


def write_gguf(checkpoint: Path, path: Path) -> Path:
    """The same checkpoint as a float32 GGUF file, laid out as llama.cpp's Qwen converter
    writes one (no rotary permutation, SmolLM2's tokenizer metadata, the chat template)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    arch = config["model_type"]
    model, pre, tokens, merges, token_types = smollm2_vocabulary()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    writer.add_chat_template(template)
    names = {
        "embed_tokens": "token_embd",
        "norm": "output_norm",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in load_file(checkpoint / "model.safetensors").items():
        name = name.removeprefix("model.")
        if name.startswith("lm_head"):
            gguf_name = "output.weight"
        elif name.startswith("layers."):
            _, layer, rest = name.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            for part in ("q", "k", "v"):
                names[f"self_attn.{part}_proj"] = f"attn_{part}"
                names[f"self_attn.{part}_norm"] = f"attn_{part}_norm"
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        else:
            module, kind = name.rsplit(".", 1)
            gguf_name = f"{names[module]}.{kind}"
        writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_qwen(
    path: Path, architecture: str = "Qwen2ForCausalLM", seed: int = 0, template: str | None = None
) -> Path:
    """A random Qwen2 (q/k/v biases) or Qwen3 (q/k norms) checkpoint directory."""
    tokenizer = smollm2_tokenizer()
    config = {
        "architectures": [architecture],
        "model_type": "qwen2" if architecture == "Qwen2ForCausalLM" else "qwen3",
        "vocab_size": tokenizer.get_vocab_size(),
        **_BASE_CONFIG,
    }
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 0.25) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale

    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], 16
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    tensors = {
        "model.embed_tokens.weight": randn(config["vocab_size"], hidden, scale=1.0),
        "model.norm.weight": 1 + randn(hidden, scale=0.1),
        "lm_head.weight": randn(config["vocab_size"], hidden, scale=0.5),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + randn(hidden, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + randn(hidden, scale=0.1),
            p + "self_attn.q_proj.weight": randn(q, hidden),
            p + "self_attn.k_proj.weight": randn(kv, hidden),
            p + "self_attn.v_proj.weight": randn(kv, hidden),
            p + "self_attn.o_proj.weight": randn(hidden, q),
            p + "mlp.gate_proj.weight": randn(inter, hidden),
            p + "mlp.up_proj.weight": randn(inter, hidden),
            p + "mlp.down_proj.weight": randn(hidden, inter),
        }
        if architecture == "Qwen2ForCausalLM":
            tensors |= {
                p + "self_attn.q_proj.bias": randn(q, scale=0.5),
                p + "self_attn.k_proj.bias": randn(kv, scale=0.5),
                p + "self_attn.v_proj.bias": randn(kv, scale=0.5),
            }
        else:
            tensors |= {
                p + "self_attn.q_norm.weight": 1 + randn(head_dim, scale=0.2),
                p + "self_attn.k_norm.weight": 1 + randn(head_dim, scale=0.2),
            }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": HERMES_TEMPLATE if template is None else template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    return path
