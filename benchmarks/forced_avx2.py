"""What "AVX2 forced" sets in a benchmark's processes: each library that picks its
instruction set from the CPU, capped at AVX2, as on a CPU that has nothing above it.

- `ATEN_CPU_CAPABILITY=avx2`: torch's own CPU kernels, and deepwell's C++ kernels, which
  build for torch's level (deepwell/engine/layers/decode_kernel.py);
- `ONEDNN_MAX_CPU_ISA=AVX2`: oneDNN (bf16 and packed linears);
- `MKL_ENABLE_INSTRUCTIONS=AVX2`: MKL, whose sgemm runs torch's float32 linears. The first
  two leave it on AVX-512: on the AMX Xeon a float32 F.linear of 1,024 rows, 576 → 3,072,
  ran at 218 GFLOP/s on one core under them and at 123 with this one too (2026-12-04), so
  the AVX2-forced figures taken before that had both engines' float32 linears on AVX-512.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python ...
"""

AVX2_ENVIRONMENT = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
