"""Writes dequant_vectors.gguf: random valid blocks of 24 GGUF tensor types and the f32
values gguf-py (the reference Python implementation that ships with llama.cpp) decodes
them to. Run by `cargo xtask testdata --vectors` with gguf==0.19.0 installed.

usage: make_vectors.py OUT.gguf [SEED]
"""

import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

VALUES = 4096

# Byte offsets, inside one block, of the f16 scales each type holds. They are set to
# small finite values so that every decoded value is finite; every other byte is random.
F16_SCALES = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ2_XXS: [0],
    T.IQ2_XS: [0],
    T.IQ2_S: [0],
    T.IQ3_XXS: [0],
    T.IQ3_S: [0],
    T.IQ1_S: [0],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
    T.TQ1_0: [52],
    T.TQ2_0: [64],
}
# MXFP4's scale is one E8M0 byte at offset 0: kept near 2^0.
E8M0_SCALE = {T.MXFP4: 0}
# IQ1_M has no f16 field: its f16 scale is spread over the top nibbles of the four
# 16-bit words of sub-scales at bytes 48..56 (the low nibble of the scale in the first).
SPLIT_SCALE = {T.IQ1_M: 48}


def random_blocks(rng, qtype):
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = VALUES // block_values
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_SCALES.get(qtype, []):
        scales = rng.uniform(0.001, 0.1, size=n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    if qtype in E8M0_SCALE:
        offset = E8M0_SCALE[qtype]
        blocks[:, offset] = rng.integers(112, 135, size=n_blocks, dtype=np.uint8)
    if qtype in SPLIT_SCALE:
        offset = SPLIT_SCALE[qtype]
        scales = rng.uniform(0.001, 0.1, size=n_blocks).astype(np.float16).view(np.uint16)
        words = blocks[:, offset : offset + 8].copy().view(np.uint16)
        for k in range(4):
            nibble = (scales >> (4 * k)) & 0xF
            words[:, k] = (words[:, k] & 0x0FFF) | (nibble << 12)
        blocks[:, offset : offset + 8] = words.view(np.uint8)
    return blocks.reshape(-1)


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    out = sys.argv[1]
    rng = np.random.default_rng(int(sys.argv[2]) if len(sys.argv) == 3 else 20240501)
    writer = gguf.GGUFWriter(out, "test")
    writer.add_description(
        "dequantization test vectors: <type>.q holds raw blocks, "
        "<type>.f32 the values gguf-py decodes them to"
    )
    for qtype in list(F16_SCALES) + list(E8M0_SCALE) + list(SPLIT_SCALE):
        raw = random_blocks(rng, qtype)
        values = dequantize(raw, qtype).astype(np.float32).reshape(-1)
        assert values.shape == (VALUES,) and np.isfinite(values).all(), qtype.name
        writer.add_tensor(f"{qtype.name}.q", raw, raw_dtype=qtype)
        writer.add_tensor(f"{qtype.name}.f32", values)
    # The float types: random normal values, stored as that type.
    f32 = rng.standard_normal(VALUES).astype(np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    writer.add_tensor("BF16.q", bf16, raw_dtype=T.BF16)
    writer.add_tensor("BF16.f32", dequantize(bf16, T.BF16).astype(np.float32).reshape(-1))
    f16 = f32.astype(np.float16)
    writer.add_tensor("F16.q", f16)
    writer.add_tensor("F16.f32", dequantize(f16.view(np.uint8), T.F16).astype(np.float32).reshape(-1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
