"""DeepSeek-V4.1's image encoder: a ViT with 2D RoPE over one image's patches, the aligner
that merges downsample² patches into one text-width embedding, and the learned start /
newline / end delimiters, giving the embeddings of the image's whole prompt span.

Facts from nemo-automodel 0.7.0 (deepseek_v4/vision.py, deepseek_v41/model.py, read, not
imported): bidirectional attention over the image, RMSNorm (eps 1e-6) with float32 scales,
SwiGLU without biases, a rotary table whose first half rotates by the patch row and second
half by its column, zero padding of the patch grid to whole cells before merging.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.deepseek_v41.checkpoint import map_vision_tensors
from deepwell.engine.models.deepseek_v41.schema import IMAGE_MARKERS, TensorSpec, vision_schema
from deepwell.engine.multimodal import ImageInput, ImageToken, image_token_kinds

_NORM_EPS = 1e-6


@dataclass(frozen=True)
class VisionConfig:
    """config.json's `vision_config`; `num_hidden_layers` 0 means no tower."""

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any] | None) -> VisionConfig | None:
        """The tower's config, or None for a checkpoint without one."""
        v = dict(vision_config or {})
        if not v.get("num_hidden_layers", 32):
            return None
        config = cls(
            num_hidden_layers=int(v.get("num_hidden_layers", 32)),
            hidden_size=int(v.get("hidden_size", 1024)),
            num_attention_heads=int(v.get("num_attention_heads", 16)),
            intermediate_size=int(v.get("intermediate_size", 2816)),
            patch_size=int(v.get("patch_size", 14)),
            rope_theta=float(v.get("rope_theta", 10000.0)),
            downsample_ratio=int(v.get("downsample_ratio", 3)),
        )
        head_dim, rest = divmod(config.hidden_size, config.num_attention_heads)
        if rest or head_dim % 4:
            # Half the head rotates by row, half by column, each in pairs.
            raise ModelLoadError(
                f"vision_config: hidden_size {config.hidden_size} over "
                f"{config.num_attention_heads} heads must give a head size divisible by 4"
            )
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class VisionNorm(nn.Module):
    """RMSNorm in float32 with a float32 scale, back in the input's dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + _NORM_EPS))).to(
            x.dtype
        )


def grid_rotation(
    rows: int, cols: int, head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows * cols, 1, head_dim / 2] for row-major patches: the first quarter of
    the head's frequencies turn with the patch's row, the second with its column."""
    half = head_dim // 2
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
    )
    row = torch.arange(rows, dtype=torch.float32, device=device).repeat_interleave(cols)
    col = torch.arange(cols, dtype=torch.float32, device=device).repeat(rows)
    angles = torch.cat((row[:, None] * inv_freq, col[:, None] * inv_freq), dim=-1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [patches, heads, head_dim] by halves (first half against second), in float32."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        patches = x.shape[0]
        q, k, v = (t.view(patches, self.heads, -1) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # Every patch sees every patch of its image.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        )
        return self.wo(out.transpose(0, 1).reshape(patches, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        # Gate and up stacked, as released.
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionNorm(config.hidden_size)
        self.attn = VisionAttention(config)
        self.norm2 = VisionNorm(config.hidden_size)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * config.patch_size**2, config.hidden_size)


class VisionTransformer(nn.Module):
    """Patches [rows * cols, 3, patch, patch] → states [rows * cols, width]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = VisionNorm(config.hidden_size)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        c = self.config
        x = self.patch_embed.proj(patches.flatten(1))
        cos, sin = grid_rotation(rows, cols, c.head_dim, c.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """ "downsample_mlp_gelu" of depth 2: each ratio x ratio cell of patch states, channel
    major, through Linear → GELU → Linear into the text width."""

    def __init__(self, config: VisionConfig, text_width: int) -> None:
        super().__init__()
        self.ratio = config.downsample_ratio
        self.w1 = nn.Linear(config.hidden_size * self.ratio**2, text_width)
        self.w2 = nn.Linear(text_width, text_width)

    def forward(self, states: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        r = self.ratio
        cell_rows, cell_cols = -(-rows // r), -(-cols // r)
        grid = states.view(rows, cols, -1).permute(2, 0, 1)
        grid = F.pad(grid, (0, cell_cols * r - cols, 0, cell_rows * r - rows))
        width = grid.shape[0]
        # [width, cell_rows, r, cell_cols, r] → one row per cell: (channel, dy, dx) order.
        cells = grid.view(width, cell_rows, r, cell_cols, r).permute(1, 3, 0, 2, 4)
        merged = cells.reshape(cell_rows * cell_cols, width * r * r)
        return self.w2(F.gelu(self.w1(merged)))


class ImageEncoder(nn.Module):
    """One image → the embeddings of its whole prompt span [span, text width]; its
    parameters carry the released names (`vision.*`, `aligner.*`, `image_*`)."""

    def __init__(
        self, config: VisionConfig, text_width: int, image_token_id: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.config = config
        self.image_token_id = image_token_id
        self.dtype = dtype
        self.vision = VisionTransformer(config)
        self.aligner = Aligner(config, text_width)
        for name in IMAGE_MARKERS:
            self.register_parameter(name, nn.Parameter(torch.zeros(text_width)))
        self.schema: dict[str, TensorSpec] = vision_schema(dataclasses.asdict(config), text_width)

    @property
    def downsample_ratio(self) -> int:
        return self.config.downsample_ratio

    @property
    def patch_size(self) -> int:
        return self.config.patch_size

    @torch.no_grad()
    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the released vision tensors: norms and markers in float32 (the reference's),
        the linears in the model's dtype."""
        for spec in self.schema.values():
            stored = tensors.get(spec.name)
            if stored is None:
                raise ModelLoadError(
                    f"the config has a vision tower but the checkpoint lacks {spec.name!r}"
                )
            path, _, attribute = spec.name.rpartition(".")
            module = self.get_submodule(path) if path else self
            target = getattr(module, attribute)
            if tuple(stored.shape) != tuple(target.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {spec.name!r} has shape {list(stored.shape)}, the "
                    f"vision tower expects {list(target.shape)}"
                )
            wanted = self.dtype if isinstance(module, nn.Linear) else torch.float32
            setattr(module, attribute, nn.Parameter(stored.to(wanted), requires_grad=False))

    @torch.no_grad()
    def forward(self, image: ImageInput) -> torch.Tensor:
        rows, cols = image.grid
        # The reference's processor hands the tower bf16 pixels.
        device = self.aligner.w1.weight.device
        pixels = torch.from_numpy(image.pixel_values).to(device, torch.bfloat16).to(self.dtype)
        states = self.vision(pixels, rows, cols)
        content = self.aligner(states, rows, cols).to(self.dtype)
        kinds = torch.tensor(
            image_token_kinds(image.grid, self.config.downsample_ratio), device=device
        )
        span = content.new_empty(kinds.numel(), content.shape[-1])
        span[kinds == ImageToken.CONTENT] = content
        span[kinds == ImageToken.START] = self.image_start.to(self.dtype)
        span[kinds == ImageToken.NEWLINE] = self.image_newline.to(self.dtype)
        span[kinds == ImageToken.END] = self.image_end.to(self.dtype)
        return span


def load_image_encoder(path: Path, dtype: torch.dtype) -> ImageEncoder:
    """The vision tower, aligner and delimiters of a released V4.1 directory and nothing
    else: what an encoder worker (`serve --encoder-workers`) runs."""
    config, tensors = map_vision_tensors(path)
    vision = VisionConfig.from_hf(config.get("vision_config"))
    width = config["text_config"]["hidden_size"]
    encoder = ImageEncoder(vision, width, config.get("image_token_id", -1), dtype)
    encoder.load(tensors)
    return encoder.eval()
