// Reference logits from llama.cpp for one model and one prompt, teacher-forced.
//
// Build against a llama.cpp build (see README.md in this folder):
//   g++ -O1 -std=c++17 logitref.cpp -I$SRC/include -I$SRC/ggml/include -I$SRC/vendor \
//       -L$BUILD/bin -Wl,-rpath,$BUILD/bin -lllama -lggml -lggml-base -o logitref
// Run:
//   logitref MODEL.gguf PROMPT.txt TOP_K SHA256 > refs.json
//
// It tokenizes the prompt file's text with llama_tokenize (add_special = true,
// parse_special = true: what llama-tokenize does by default), evaluates every token in
// one batch on the CPU (2 threads, flash attention off, the default f16 KV cache, one
// micro-batch for the whole sequence) with logits at every position, and prints one JSON
// object: the tokens, and per position the TOP_K largest logits with their ids (largest
// first, ties to the lower id) and the log-sum-exp of the whole row. SHA256 is recorded
// as given: the caller passes the file's hash so that the reference names the exact
// bytes it was made from.
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
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPT.txt TOP_K SHA256\n", argv[0]);
        return 2;
    }
    const int top_k = std::atoi(argv[3]);
    std::ifstream prompt_file(argv[2], std::ios::binary);
    if (!prompt_file || top_k <= 0) {
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
    cparams.n_ctx = std::max(n, 64);
    cparams.n_batch = cparams.n_ctx;
    cparams.n_ubatch = cparams.n_ctx;
    cparams.n_seq_max = 1;
    cparams.n_threads = 2;
    cparams.n_threads_batch = 2;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
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
    out["prompt"] = prompt;
    out["n_vocab"] = n_vocab;
    out["tokens"] = tokens;
    out["top_k"] = top_k;
    out["positions"] = json::array();
    std::vector<int> order(n_vocab);
    for (int i = 0; i < n; i++) {
        const float * logits = llama_get_logits_ith(ctx, i);
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
        out["positions"].push_back(p);
    }
    // One position per line keeps the file diff-friendly.
    printf("{\n");
    size_t field = 0;
    for (auto it = out.begin(); it != out.end(); ++it, ++field) {
        if (it.key() == "positions") {
            printf("  \"positions\": [\n");
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
