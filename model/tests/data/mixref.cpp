// The per-tensor types llama-quantize's preset FTYPE chooses for a model's tensors.
//
// Build against a llama.cpp build (see README.md in this folder; the functions are the
// ones llama.cpp's own test-quant-type-selection calls, declared in src/llama-ext.h):
//   g++ -O1 -std=c++17 mixref.cpp -I$SRC/include -I$SRC/ggml/include -I$SRC/src \
//       -L$BUILD/bin -Wl,-rpath,$BUILD/bin -lllama -lggml -lggml-base -o mixref
// Run:
//   mixref MODEL.gguf FTYPE > mixes/NAME.txt     (FTYPE: Q3_K_S, IQ4_XS, ...)
//
// It reads the model's tensor names and shapes and its architecture's hyperparameters
// (width, feed-forward width, layers, heads, KV heads, experts) from the GGUF file, builds
// llama.cpp's mock model of them, and runs llama.cpp's type selection (the rules of
// llama_tensor_get_type in llama-quant.cpp, with its fallbacks for rows that are not a
// whole number of blocks; no importance matrix) for the preset. It prints one line per
// tensor llama-quantize would quantize, in the loader's order: `NAME TYPE`.
#include "gguf.h"
#include "llama-ext.h"
#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

struct ftype_name {
    const char * name;
    llama_ftype  ftype;
};

static const ftype_name ftypes[] = {
    { "Q2_K", LLAMA_FTYPE_MOSTLY_Q2_K },     { "Q3_K_S", LLAMA_FTYPE_MOSTLY_Q3_K_S },
    { "Q3_K_M", LLAMA_FTYPE_MOSTLY_Q3_K_M }, { "Q3_K_L", LLAMA_FTYPE_MOSTLY_Q3_K_L },
    { "Q4_K_S", LLAMA_FTYPE_MOSTLY_Q4_K_S }, { "Q4_K_M", LLAMA_FTYPE_MOSTLY_Q4_K_M },
    { "Q5_K_S", LLAMA_FTYPE_MOSTLY_Q5_K_S }, { "Q5_K_M", LLAMA_FTYPE_MOSTLY_Q5_K_M },
    { "Q6_K", LLAMA_FTYPE_MOSTLY_Q6_K },     { "IQ2_M", LLAMA_FTYPE_MOSTLY_IQ2_M },
    { "IQ3_M", LLAMA_FTYPE_MOSTLY_IQ3_M },   { "IQ4_XS", LLAMA_FTYPE_MOSTLY_IQ4_XS },
    { "TQ1_0", LLAMA_FTYPE_MOSTLY_TQ1_0 },   { "TQ2_0", LLAMA_FTYPE_MOSTLY_TQ2_0 },
};

static uint32_t get_u32(const gguf_context * g, const std::string & key, uint32_t fallback) {
    const int64_t id = gguf_find_key(g, key.c_str());
    return id < 0 ? fallback : gguf_get_val_u32(g, id);
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL.gguf FTYPE\n", argv[0]);
        return 2;
    }
    llama_ftype ftype = (llama_ftype) -1;
    for (const auto & f : ftypes) {
        if (strcmp(f.name, argv[2]) == 0) {
            ftype = f.ftype;
        }
    }
    if ((int) ftype < 0) {
        fprintf(stderr, "unknown FTYPE %s\n", argv[2]);
        return 2;
    }
    ggml_context *   meta   = nullptr;
    gguf_init_params params = { /* no_alloc */ true, &meta };
    gguf_context *   g      = gguf_init_from_file(argv[1], params);
    if (!g) {
        fprintf(stderr, "cannot read %s\n", argv[1]);
        return 1;
    }
    const std::string arch = gguf_get_val_str(g, gguf_find_key(g, "general.architecture"));
    llama_quant_model_desc desc = {};
    desc.architecture  = arch.c_str();
    desc.n_embd        = get_u32(g, arch + ".embedding_length", 0);
    desc.n_ff          = get_u32(g, arch + ".feed_forward_length", 0);
    desc.n_layer       = get_u32(g, arch + ".block_count", 0);
    desc.n_head        = get_u32(g, arch + ".attention.head_count", 0);
    desc.n_head_kv     = get_u32(g, arch + ".attention.head_count_kv", desc.n_head);
    desc.n_expert      = get_u32(g, arch + ".expert_count", 0);
    desc.n_embd_head_k = get_u32(g, arch + ".attention.key_length", desc.n_embd / desc.n_head);
    desc.n_embd_head_v = get_u32(g, arch + ".attention.value_length", desc.n_embd / desc.n_head);
    llama_model * model = llama_quant_model_from_metadata(&desc);

    llama_model_quantize_params qparams = llama_model_quantize_default_params();
    qparams.ftype                       = ftype;
    quantize_state_impl * qs            = llama_quant_init(model, &qparams);

    // Every tensor is offered as F32, as from an F32 source, in the loader's order (by
    // layer, then by name), which the counters of attn_v layers rely on.
    std::vector<ggml_tensor *> tensors;
    for (ggml_tensor * t = ggml_get_first_tensor(meta); t; t = ggml_get_next_tensor(meta, t)) {
        t->type = GGML_TYPE_F32;
        if (llama_quant_tensor_allows_quantization(qs, t)) {
            tensors.push_back(t);
        }
    }
    std::stable_sort(tensors.begin(), tensors.end(), [](const ggml_tensor * a, const ggml_tensor * b) {
        int la = -1, lb = -1;
        sscanf(a->name, "blk.%d.", &la);
        sscanf(b->name, "blk.%d.", &lb);
        return la != lb ? la < lb : strcmp(a->name, b->name) < 0;
    });
    std::vector<ggml_type> types(tensors.size());
    llama_quant_compute_types(qs, ftype, tensors.data(), types.data(), tensors.size());
    for (size_t i = 0; i < tensors.size(); i++) {
        printf("%s %s\n", ggml_get_name(tensors[i]), ggml_type_name(types[i]));
    }
    llama_quant_free(qs);
    llama_model_free(model);
    gguf_free(g);
    ggml_free(meta);
    return 0;
}
