"""Paged attention on CPU with decode rows in the fused C++ kernel (paged_decode.cpp), and
the choice between it and the pure-torch backend (`--attention-backend`).

The kernel walks each sequence's block list once per KV head with an online softmax, for all
its decode rows (a draft's verify rows share their blocks): no gather, no per-block GEMM
calls, no padded scores; it also stores the step's K/V rows (one copy per row). Prefill
chunks in bf16 run prefill_attention.cpp (flash-style over the paged cache, no gather, no
mask; on AMX tiles where they run); other dtypes and head sizes the torch path.
"""

import functools
import logging
from types import ModuleType

import torch

from deepwell.engine.layers.attention import AttentionBackend, AttentionMetadata, PrefillSpan
from deepwell.engine.layers.decode_kernel import load_decode_kernel, load_prefill_kernel
from deepwell.engine.layers.torch_paged import TorchPagedAttention

logger = logging.getLogger(__name__)

# paged_decode.cpp's kMaxGroup: a KV head's query heads keep their accumulators in registers.
MAX_GROUP = 8
# prefill_attention.cpp's value tiles: head dims in whole runs of 64.
PREFILL_DIM_MULTIPLE = 64


class CppPagedAttention(TorchPagedAttention):
    """Decodes in the kernel when it loads (built on the first instance), else on the torch
    path, said once in the log."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.kernel = _decode_kernel()
        if self.kernel is not None and self.group > MAX_GROUP:
            _log_group_fallback(self.group)
            self.kernel = None
        self.prefill_kernel = _prefill_kernel() if head_dim % PREFILL_DIM_MULTIPLE == 0 else None

    def _store(self, k, v, key_cache, value_cache, meta: AttentionMetadata) -> None:
        if self.kernel is None:
            super()._store(k, v, key_cache, value_cache, meta)
        else:
            self.kernel.paged_store(
                k, v, key_cache, value_cache, meta.slot_blocks, meta.slot_offsets
            )

    def _prefill(self, q, k, v, key_cache, value_cache, span: PrefillSpan) -> torch.Tensor:
        bf16 = q.dtype == key_cache.dtype == torch.bfloat16
        if self.prefill_kernel is None or not bf16:
            return super()._prefill(q, k, v, key_cache, value_cache, span)
        out = torch.empty(q.shape, dtype=q.dtype)
        self.prefill_kernel.chunk_attention(
            q, key_cache, value_cache, span.block_table, span.context_len, self.scale, out
        )
        return out

    def _decode(self, q, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.kernel is None:
            return super()._decode(q, key_cache, value_cache, meta)
        return self.kernel.paged_decode(
            q,
            key_cache,
            value_cache,
            meta.decode_block_ids,
            meta.decode_block_starts,
            meta.decode_context_len_tensor,
            meta.decode_sequence_starts,
            self.scale,
            False,
        )


@functools.cache
def _decode_kernel() -> ModuleType | None:
    kernel = load_decode_kernel()
    if kernel.module is None:
        logger.warning(
            "decode attention: torch path, the C++ kernel is unavailable: %s", kernel.reason
        )
    else:
        logger.info("decode attention: C++ kernel (%s)", kernel.reason)
    return kernel.module


@functools.cache
def _prefill_kernel() -> ModuleType | None:
    """The bf16 prefill attention kernel where it builds and this CPU has AVX512_BF16; else
    None (torch's SDPA runs the chunks), said once in the log."""
    kernel = load_prefill_kernel()
    if kernel.module is None:
        logger.warning(
            "prefill attention: torch SDPA, the C++ kernel is unavailable: %s", kernel.reason
        )
        return None
    if not kernel.module.vectorised():
        logger.info("prefill attention: torch SDPA (the C++ kernel needs AVX512_BF16)")
        return None
    form = "AMX tiles" if kernel.module.on_tiles() else "AVX512_BF16"
    logger.info("prefill attention: C++ kernel for bf16 on %s (%s)", form, kernel.reason)
    return kernel.module


@functools.cache
def _log_group_fallback(group: int) -> None:
    logger.warning(
        "decode attention: the C++ kernel takes up to %d query heads per KV head, this "
        "model has %d; it decodes on the torch path",
        MAX_GROUP,
        group,
    )


def paged_backend_class(choice: str) -> type[AttentionBackend]:
    """The backend for `--attention-backend`: "torch"; "cpp", which must load the kernel now
    (an error naming why it cannot); or "auto", whose first instance tries to."""
    if choice == "torch":
        logger.info("decode attention: torch path (--attention-backend torch)")
        return TorchPagedAttention
    if choice == "cpp":
        kernel = load_decode_kernel()
        if kernel.module is None:
            raise RuntimeError(
                f"--attention-backend cpp: the decode attention kernel is not available: "
                f"{kernel.reason}"
            )
    return CppPagedAttention
