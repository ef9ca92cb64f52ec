// Reference logits from llama.cpp for one model and one prompt, teacher-forced.
//
// Build against a llama.cpp build (see README.md in this folder):
//   g++ -O1 -std=c++17 logitref.cpp -I$SRC/include -I$SRC/ggml/include -I$SRC/vendor \
//       -L$BUILD/bin -Wl,-rpath,$BUILD/bin -lllama -lggml -lggml-base -o logitref
// Run:
//   logitref MODEL.gguf PROMPT.txt TOP_K SHA256 [GREEDY [FLASH_ATTN [TYPE_K [TYPE_V]]]] > refs.json
//
// It tokenizes the prompt file's text with llama_tokenize (add_special = true,
// parse_special = true: what llama-tokenize does by default), evaluates every token in
// one batch on the CPU (2 threads, flash attention as FLASH_ATTN says, the KV cache types
// TYPE_K and TYPE_V say, one micro-batch for the whole sequence) with logits at every
// position, and prints one JSON object: the tokens, and per position the TOP_K largest
// logits with their ids (largest first, ties to the lower id) and the log-sum-exp of the
// whole row. SHA256 is recorded as given: the caller passes the file's hash so that the
// reference names the exact bytes it was made from.
//
// With GREEDY > 0 it then decodes greedily from the prompt: the prompt again in one batch,
// then GREEDY tokens one at a time (each its own batch of one, as llama-completion
// generates), and adds `greedy_tokens` and `greedy_positions`: for each generated token,
// the TOP_K logits and log-sum-exp of the row it was taken from (the prompt's last row
// first). A batch of one takes llama.cpp's single-token dot products where the prompt's
// batch takes its tiled products, so the two parts check different kernels.
//
// FLASH_ATTN is `off` (the default) or `on`: llama.cpp's `-fa`. The context is the
// sequence's length (at least 64), which llama.cpp rounds up to 256.
//
// TYPE_K and TYPE_V are the KV cache's element types, `f16` (the default), `q8_0` or
// `q4_0`: llama.cpp's `-ctk` and `-ctv`. Given, they are recorded as `type_k` and
// `type_v`; left out, the output is what it was before they existed. A quantized V cache
// needs flash attention.
#include "llama.h"
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

using json = nlohmann::ordered_json;

static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text) {
    std::vector<llama_token> ids(text.size() + 8);
    int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), true, true);
    if (n < 0) {
        ids.resize(-n);
        n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), true, true);
    }
    ids.resize(n);
    return ids;
}

// Five decimals are far below any tolerance and keep the file short.
static double rounded(double v) {
    return std::round(v * 1e5) / 1e5;
}

int main(int argc, char ** argv) {
    if (argc < 5 || argc > 9) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPT.txt TOP_K SHA256 [GREEDY [on|off [TYPE_K [TYPE_V]]]]\n"
                        "       TYPE_K, TYPE_V: f16 (default), q8_0 or q4_0\n", argv[0]);
        return 2;
    }
    const int top_k = std::atoi(argv[3]);
    const int greedy = argc >= 6 ? std::atoi(argv[5]) : 0;
    const std::string flash = argc >= 7 ? argv[6] : "off";
    const bool cache_types = argc >= 8;
    const std::string type_k = argc >= 8 ? argv[7] : "f16";
    const std::string type_v = argc >= 9 ? argv[8] : "f16";
    auto cache_type = [](const std::string & name, ggml_type * type) {
        if (name == "f16") {
            *type = GGML_TYPE_F16;
        } else if (name == "q8_0") {
            *type = GGML_TYPE_Q8_0;
        } else if (name == "q4_0") {
            *type = GGML_TYPE_Q4_0;
        } else {
            return false;
        }
        return true;
    };
    ggml_type ggml_type_k = GGML_TYPE_F16;
    ggml_type ggml_type_v = GGML_TYPE_F16;
    if (!cache_type(type_k, &ggml_type_k) || !cache_type(type_v, &ggml_type_v)) {
        fprintf(stderr, "bad cache type %s or %s (f16, q8_0 or q4_0)\n", type_k.c_str(), type_v.c_str());
        return 2;
    }
    std::ifstream prompt_file(argv[2], std::ios::binary);
    if (!prompt_file || top_k <= 0 || greedy < 0 || (flash != "on" && flash != "off")) {
        fprintf(stderr, "cannot read %s, or bad TOP_K %s\n", argv[2], argv[3]);
        return 2;
    }
    std::stringstream prompt_buf;
    prompt_buf << prompt_file.rdbuf();
    const std::string prompt = prompt_buf.str();

    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) {
            fputs(text, stderr);
        }
    }, nullptr);
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.progress_callback = [](float, void *) { return true; };
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const std::vector<llama_token> tokens = tokenize(vocab, prompt);
    const int n = (int) tokens.size();

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = std::max(n + greedy, 64);
    cparams.n_batch = cparams.n_ctx;
    cparams.n_ubatch = cparams.n_ctx;
    cparams.n_seq_max = 1;
    cparams.n_threads = 2;
    cparams.n_threads_batch = 2;
    cparams.flash_attn_type = flash == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cparams.type_k = ggml_type_k;
    cparams.type_v = ggml_type_v;
    cparams.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        fprintf(stderr, "cannot create a context for %s\n", argv[1]);
        return 1;
    }

    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = true;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "llama_decode failed on %s\n", argv[1]);
        return 1;
    }

    std::string model_name = argv[1];
    model_name = model_name.substr(model_name.find_last_of('/') + 1);
    json out;
    out["model"] = model_name;
    out["sha256"] = argv[4];
    out["flash_attn"] = flash;
    if (cache_types) {
        out["type_k"] = type_k;
        out["type_v"] = type_v;
    }
    out["prompt"] = prompt;
    out["n_vocab"] = n_vocab;
    out["tokens"] = tokens;
    out["top_k"] = top_k;
    out["positions"] = json::array();
    std::vector<int> order(n_vocab);
    auto summary = [&](const float * logits) {
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
        double max = logits[order[0]];
        double sum = 0.0;
        for (int v = 0; v < n_vocab; v++) {
            sum += std::exp((double) logits[v] - max);
        }
        json ids = json::array();
        json values = json::array();
        for (int k = 0; k < top_k && k < n_vocab; k++) {
            ids.push_back(order[k]);
            values.push_back(rounded(logits[order[k]]));
        }
        json p;
        p["ids"] = ids;
        p["logits"] = values;
        p["logsumexp"] = rounded(max + std::log(sum));
        return p;
    };
    for (int i = 0; i < n; i++) {
        out["positions"].push_back(summary(llama_get_logits_ith(ctx, i)));
    }
    if (greedy > 0) {
        llama_memory_clear(llama_get_memory(ctx), true);
        for (int i = 0; i < n; i++) {
            batch.logits[i] = i == n - 1;
        }
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama_decode failed on %s\n", argv[1]);
            return 1;
        }
        out["greedy_tokens"] = json::array();
        out["greedy_positions"] = json::array();
        const float * logits = llama_get_logits_ith(ctx, -1);
        for (int step = 0; step < greedy; step++) {
            json p = summary(logits);
            const llama_token next = p["ids"][0];
            out["greedy_tokens"].push_back(next);
            out["greedy_positions"].push_back(p);
            if (step + 1 == greedy) {
                break;
            }
            llama_batch one = llama_batch_get_one(const_cast<llama_token *>(&next), 1);
            if (llama_decode(ctx, one) != 0) {
                fprintf(stderr, "llama_decode failed on %s\n", argv[1]);
                return 1;
            }
            logits = llama_get_logits_ith(ctx, -1);
        }
    }
    // One position per line keeps the file diff-friendly.
    printf("{\n");
    size_t field = 0;
    for (auto it = out.begin(); it != out.end(); ++it, ++field) {
        if (it.key() == "positions" || it.key() == "greedy_positions") {
            printf("  %s: [\n", json(it.key()).dump().c_str());
            for (size_t i = 0; i < it.value().size(); i++) {
                printf("    %s%s\n", it.value()[i].dump().c_str(), i + 1 < it.value().size() ? "," : "");
            }
            printf("  ]");
        } else {
            printf("  %s: %s", json(it.key()).dump().c_str(), it.value().dump().c_str());
        }
        printf("%s\n", field + 1 < out.size() ? "," : "");
    }
    printf("}\n");

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
