"""The released weight encodings (spec §3.8) decoded from raw bytes inside Triton kernels.

Arithmetic on the bits, exact, and in no dtype Triton's interpreter lacks (it has no fp8 or
e8m0): a portable GPU kernel decodes the same way. Bytes come in as int32 values 0..255.
"""

import triton
import triton.language as tl


@triton.jit
def decode_e8m0(byte):
    """E8M0 scale byte b → float32 2^(b − 127): b itself is a float32's exponent field;
    b = 0 is the subnormal 2^−127 (mantissa bit 22). 255 (NaN) is never released."""
    bits = tl.where(byte == 0, 1 << 22, byte << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def decode_e4m3(byte):
    """FP8 E4M3 (bias 7) byte → float32: a normal's exponent rebiased to 127 and its three
    mantissa bits moved up; a subnormal is mantissa · 2^−9. 0x7F / 0xFF (NaN) are never
    released."""
    exponent = (byte >> 3) & 15
    mantissa = byte & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    return tl.where(byte >= 128, -magnitude, magnitude)


@triton.jit
def decode_e2m1(code):
    """E2M1 code 0..15 (bit 3 the sign) → float32: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6,
    i.e. m / 2 for exponent 0, else (2 + m) · 2^(e − 2)."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = (2 + mantissa).to(tl.float32) * (1 << exponent).to(tl.float32) * 0.25
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    return tl.where(code >= 8, -magnitude, magnitude)
