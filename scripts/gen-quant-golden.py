#!/usr/bin/env python3
"""Writes spec/data/quant-golden.bin: random blocks of every weight format
with the values the gguf Python package's reference dequantizer gives for
them, plus Q8_0 quantizations of random floats, which spec/native/test_quant.c
compares luma's scalar code against.

File layout (little-endian):
  magic b"LQGD", u32 version (1), u32 entry count, then per entry:
  u32 kind (0: dequantize bytes -> floats, 1: quantize floats -> bytes),
  u32 ggml type, u32 element count n, u32 byte count,
  the block bytes, then n float32 values.

Run from the repository root: python3 scripts/gen-quant-golden.py
"""
import struct
import sys

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

rng = np.random.default_rng(20240521)

# Byte offsets of the half-float scales inside one block: (offset, signed).
# d and dmin are kept positive as quantizers write them; Q4_1/Q5_1 minimums
# take either sign.
SCALES = {
    T.Q4_0: [(0, False)],
    T.Q4_1: [(0, False), (2, True)],
    T.Q5_0: [(0, False)],
    T.Q5_1: [(0, False), (2, True)],
    T.Q8_0: [(0, False)],
    T.Q2_K: [(80, False), (82, False)],
    T.Q3_K: [(108, False)],
    T.Q4_K: [(0, False), (2, False)],
    T.Q5_K: [(0, False), (2, False)],
    T.Q6_K: [(208, False)],
}


def random_blocks(qtype, n_blocks):
    """Random bytes with sane scales: each half float in [1e-3, 1e-1]."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off, signed in SCALES[qtype]:
        v = rng.uniform(1e-3, 1e-1, size=n_blocks).astype(np.float16)
        if signed:
            v = v * rng.choice(np.array([-1, 1], dtype=np.float16), size=n_blocks)
        data[:, off:off + 2] = v.view(np.uint8).reshape(n_blocks, 2)
    return data.reshape(-1)


def float_edges():
    """Values that exercise rounding, subnormals, zeros and infinities."""
    edges = [0.0, -0.0, 1.0, -2.5, 65504.0, -65504.0, 6.1035156e-05, 5.9604645e-08,
             2.9802322e-08, 1e-10, np.inf, -np.inf, 3.0e38, 1.1754944e-38]
    return np.array(edges, dtype=np.float32)


def entries():
    n = 512
    x = np.concatenate([float_edges(), rng.standard_normal(n - len(float_edges())).astype(np.float32)])
    yield 0, T.F32, x.view(np.uint8), dequantize(x.view(np.uint8), T.F32)
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    h[:4] = np.array([0x0001, 0x03ff, 0x8200, 0x7bff], dtype=np.uint16).view(np.float16)  # subnormals, max
    yield 0, T.F16, h.view(np.uint8), dequantize(h.view(np.uint8), T.F16)
    b = quantize(x, T.BF16)
    yield 0, T.BF16, b, dequantize(b, T.BF16)
    for qtype in SCALES:
        block_size, _ = GGML_QUANT_SIZES[qtype]
        n_blocks = 64 if block_size == 32 else 8
        data = random_blocks(qtype, n_blocks)
        yield 0, qtype, data, dequantize(data, qtype)
    # Q8_0 quantization: the package reproduces GGML's quantize_row_q8_0.
    for scale in (1.0, 1e-3, 300.0):
        f = (rng.standard_normal(1024) * scale).astype(np.float32)
        f[::97] = 0.0
        if scale == 1.0:  # a block with d = 1 and ties: roundf goes away from zero
            f[:8] = [127.0, 0.5, -0.5, 1.5, -2.5, 126.5, -126.5, 3.25]
        yield 1, T.Q8_0, quantize(f, T.Q8_0).reshape(-1), f


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "spec/data/quant-golden.bin"
    items = list(entries())
    with open(out, "wb") as fh:
        fh.write(b"LQGD" + struct.pack("<II", 1, len(items)))
        for kind, qtype, data, values in items:
            data = np.ascontiguousarray(data, dtype=np.uint8)
            values = np.ascontiguousarray(values, dtype="<f4").reshape(-1)
            fh.write(struct.pack("<IIII", kind, int(qtype), values.size, data.size))
            fh.write(data.tobytes())
            fh.write(values.tobytes())
    print(f"wrote {len(items)} entries to {out}")


if __name__ == "__main__":
    main()
