"""Vocabulary-only copies of SmolLM2 with `tokenizer.ggml.pre` set to each other BPE
pre-tokenizer, so llama.cpp can make reference ids for them on a real vocabulary.

    pip install gguf
    python3 make_pre_variants.py ~/.cache/rocmforge/models/SmolLM2-135M-Instruct.Q4_1.gguf OUTDIR
"""
import sys

from gguf import GGUFReader, GGUFValueType, GGUFWriter

PRE_TOKENIZERS = ["llama-bpe", "qwen2", "gpt-2", "default"]


def main(src: str, out_dir: str) -> None:
    reader = GGUFReader(src)
    for pre in PRE_TOKENIZERS:
        writer = GGUFWriter(f"{out_dir}/variant-{pre}.gguf", arch="llama")
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            kind = field.types[0]
            if key == "tokenizer.ggml.pre":
                writer.add_string(key, pre)
            elif kind == GGUFValueType.ARRAY:
                if field.types[1] == GGUFValueType.STRING:
                    values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
                else:
                    values = [field.parts[i].tolist()[0] for i in field.data]
                writer.add_array(key, values)
            elif kind == GGUFValueType.STRING:
                writer.add_string(key, bytes(field.parts[field.data[0]]).decode("utf-8"))
            else:
                writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
