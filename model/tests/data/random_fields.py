#!/usr/bin/env python3
"""Writes a small model whose quantized blocks are random in every field.

    python3 random_fields.py OUT.gguf ARCH TYPE SEED GAIN TOKENIZER.gguf

ARCH is llama or phi3 (fused attn_qkv and a 2 x n_ff ffn_up, 4 KV heads, no rope-scaling
keys); TYPE any gguf-py quantization type name, for every layer matrix; the embeddings and
the output are Q8_0. Every byte of every block is drawn at random, then each block's f16
scales (MXFP4's exponent byte, IQ1_M's scale nibbles) are set to one value chosen so the
weights have the RMS a unit-gain model needs, times GAIN. The tokenizer is copied from
TOKENIZER.gguf (SmolLM2's, from `cargo xtask fetch-models`). 2 layers of width 256, ffn
512, heads of 64. Needs `gguf==0.19.0` and numpy.
"""
import sys
import numpy as np
import gguf
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ3_XXS: [0], T.IQ1_S: [0], T.IQ4_NL: [0],
    T.IQ3_S: [0], T.IQ2_S: [0], T.IQ4_XS: [0], T.TQ1_0: [52], T.TQ2_0: [64],
}


def set_d(blocks, ty, d):
    """Sets every f16 scale field of `blocks` (n x size uint8) to d."""
    h = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    if ty == T.MXFP4:
        e = int(round(np.log2(d))) + 127
        blocks[:, 0] = max(1, min(254, e))
        return
    if ty == T.IQ1_M:
        bits = int(np.frombuffer(np.float16(d).tobytes(), dtype=np.uint16)[0])
        sc = blocks[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            nib = (bits >> (4 * k)) & 0xF
            sc[:, k] = (sc[:, k] & 0x0FFF) | (nib << 12)
        blocks[:, 48:56] = sc.view(np.uint8)
        return
    for off in F16_FIELDS[ty]:
        blocks[:, off:off + 2] = h


def rand_tensor(rng, ty, rows, cols, target_rms):
    if ty in (T.F32, T.F16, T.BF16):
        x = rng.standard_normal((rows, cols)).astype(np.float32) * target_rms
        if ty == T.F32:
            return x, ty
        if ty == T.F16:
            return x.astype(np.float16), ty
        b = (x.view(np.uint32) >> 16).astype(np.uint16)
        return b.view(np.uint8).reshape(rows, cols * 2), ty
    bs, size = GGML_QUANT_SIZES[ty]
    nb = rows * cols // bs
    blocks = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    set_d(blocks, ty, 1.0)
    vals = dequantize(blocks.reshape(-1), ty)
    rms = float(np.sqrt(np.mean(vals.astype(np.float64) ** 2)))
    set_d(blocks, ty, target_rms / rms)
    return blocks.reshape(rows, cols // bs * size), ty


def main():
    if len(sys.argv) != 7:
        sys.exit(__doc__)
    out, arch, mat_type = sys.argv[1], sys.argv[2], T[sys.argv[3]]
    seed, gain, tok_src = int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
    rng = np.random.default_rng(seed)
    n_embd, n_ff, n_layer, n_head, n_kv, hd = 256, 512, 2, 4, 2, 64
    if arch == "phi3":
        n_kv = 4
    reader = gguf.GGUFReader(tok_src)
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(1)
    for f in reader.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        if f.name == "tokenizer.chat_template":
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            et = f.types[1]
            if et == gguf.GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            w.add_array(f.name, vals)
        elif t == gguf.GGUFValueType.STRING:
            w.add_string(f.name, bytes(f.parts[-1]).decode())
        else:
            w.add_key_value(f.name, f.parts[-1].tolist()[0], t)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)

    def add(name, ty, rows, cols, rms):
        if not name.startswith(("token_embd", "output")):
            rms *= gain
        data, t = rand_tensor(rng, ty, rows, cols, rms)
        if t in (T.F32, T.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=t)

    def norm(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    add("token_embd.weight", T.Q8_0, n_vocab, n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", n_embd)
        if arch == "phi3":
            add(p + "attn_qkv.weight", mat_type, n_head * hd + 2 * n_kv * hd, n_embd, 1.5 / 16)
        else:
            add(p + "attn_q.weight", mat_type, n_head * hd, n_embd, 1.5 / 16)
            add(p + "attn_k.weight", mat_type, n_kv * hd, n_embd, 1.5 / 16)
            add(p + "attn_v.weight", mat_type, n_kv * hd, n_embd, 1.0 / 16)
        add(p + "attn_output.weight", mat_type, n_embd, n_head * hd, 0.5 / 16)
        norm(p + "ffn_norm.weight", n_embd)
        if arch == "phi3":
            add(p + "ffn_up.weight", mat_type, 2 * n_ff, n_embd, 1.0 / 16)
        else:
            add(p + "ffn_gate.weight", mat_type, n_ff, n_embd, 1.0 / 16)
            add(p + "ffn_up.weight", mat_type, n_ff, n_embd, 1.0 / 16)
        add(p + "ffn_down.weight", mat_type, n_embd, n_ff, 0.5 / 22.6)
    norm("output_norm.weight", n_embd)
    add("output.weight", T.Q8_0, n_vocab, n_embd, 0.25)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


main()
