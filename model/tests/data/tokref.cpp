// Reference token ids from llama.cpp's tokenizer for a corpus of strings.
//
// Build against a llama.cpp build (see README.md in this folder):
//   g++ -O1 -std=c++17 tokref.cpp -I$SRC/include -I$SRC/ggml/include -I$SRC/vendor \
//       -L$BUILD/bin -Wl,-rpath,$BUILD/bin -lllama -lggml -lggml-base -o tokref
// Run:
//   tokref MODEL.gguf tokenizer_corpus.json > refs.json
//
// For each string it records the ids of llama_tokenize with add_special = true and
// parse_special = true (what llama-tokenize does by default) and with parse_special =
// false, and the text llama_detokenize gives back for the first list (special tokens
// rendered, nothing removed).
#include "llama.h"
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

using json = nlohmann::ordered_json;

static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text, bool parse_special) {
    std::vector<llama_token> ids(text.size() + 8);
    int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), true, parse_special);
    if (n < 0) {
        ids.resize(-n);
        n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), true, parse_special);
    }
    ids.resize(n);
    return ids;
}

static std::string detokenize(const llama_vocab * vocab, const std::vector<llama_token> & ids) {
    std::string text(ids.size() * 16 + 16, '\0');
    int n = llama_detokenize(vocab, ids.data(), (int) ids.size(), text.data(), (int) text.size(), false, true);
    if (n < 0) {
        text.resize(-n);
        n = llama_detokenize(vocab, ids.data(), (int) ids.size(), text.data(), (int) text.size(), false, true);
    }
    text.resize(n);
    return text;
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL.gguf CORPUS.json\n", argv[0]);
        return 2;
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], params);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::ifstream in(argv[2]);
    const json corpus = json::parse(in);

    std::string model_name = argv[1];
    model_name = model_name.substr(model_name.find_last_of('/') + 1);
    json out;
    out["model"] = model_name;
    out["add_bos"] = llama_vocab_get_add_bos(vocab);
    out["cases"] = json::array();
    for (const auto & item : corpus) {
        const std::string text = item.get<std::string>();
        const auto special = tokenize(vocab, text, true);
        const auto plain = tokenize(vocab, text, false);
        json c;
        c["text"] = text;
        c["parse_special"] = special;
        c["plain"] = plain;
        c["detokenized"] = detokenize(vocab, special);
        out["cases"].push_back(c);
    }
    // One case per line keeps the file diff-friendly.
    printf("{\"model\": %s, \"add_bos\": %s, \"cases\": [\n", out["model"].dump().c_str(), out["add_bos"].dump().c_str());
    for (size_t i = 0; i < out["cases"].size(); ++i) {
        printf("%s%s\n", out["cases"][i].dump(-1, ' ', false, json::error_handler_t::replace).c_str(),
               i + 1 < out["cases"].size() ? "," : "");
    }
    printf("]}\n");
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
