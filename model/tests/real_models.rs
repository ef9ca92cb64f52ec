//! Tests on the two real models (SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M),
//! against llama.cpp's outputs in `testdata/golden`. The models come from
//! `cargo xtask fetch-models`; these tests fail, saying so, when they are missing.

#[path = "real_models/chat.rs"]
mod chat;
#[path = "real_models/common.rs"]
mod common;
#[path = "real_models/constraint.rs"]
mod constraint;
#[path = "real_models/embedding.rs"]
mod embedding;
#[path = "real_models/forward.rs"]
mod forward;
#[path = "real_models/generate.rs"]
mod generate;
#[path = "real_models/serve.rs"]
mod serve;
#[path = "real_models/synthetic.rs"]
mod synthetic;
#[path = "real_models/tokenizer.rs"]
mod tokenizer;
