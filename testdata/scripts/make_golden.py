"""Writes llama.cpp's reference outputs for one model: tokenization, greedy text and the
top-10 logits at every position. Run by `cargo xtask testdata --golden` with
llama-cpp-python==0.3.36 built from its source package for AVX2 (llama.cpp's float order
depends on the instruction set it is built for).

usage: make_golden.py MODEL.gguf OUT.json
"""

import json
import os
import sys

import numpy as np
import llama_cpp
from llama_cpp import Llama

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
]
N_GEN = 32
TOP = 10


def top10(row):
    # Highest first; equal logits in id order, as a stable sort gives them.
    order = np.argsort(-row, kind="stable")[:TOP]
    return {
        "ids": [int(i) for i in order],
        "logits": [round(float(row[i]), 4) for i in order],
    }


def case(llm, prompt):
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    # BOS where the model's metadata asks for it; control tokens written in the text
    # are recognised, as for a prompt.
    tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
    llm.reset()
    llm.eval(tokens)
    greedy = []
    while len(greedy) < N_GEN:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            break
        greedy.append(token)
        llm.eval([token])
    text = llm.detokenize(greedy).decode("utf-8", errors="replace")
    # The whole sequence in one pass (teacher forcing): position i predicts token i+1.
    llm.reset()
    llm.eval(tokens + greedy)
    top = [top10(llm.scores[i]) for i in range(len(tokens) + len(greedy))]
    return {
        "prompt": prompt,
        "prompt_tokens": tokens,
        "greedy_tokens": greedy,
        "greedy_text": text,
        "top10_per_position": top,
    }


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model, out = sys.argv[1], sys.argv[2]
    llm = Llama(
        model_path=model,
        n_ctx=512,
        n_batch=512,
        n_threads=2,
        logits_all=True,
        verbose=False,
    )
    golden = {
        "model": os.path.basename(model),
        "n_gen": N_GEN,
        "cases": [case(llm, p) for p in PROMPTS],
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
