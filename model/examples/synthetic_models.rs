//! Writes the synthetic models that `tests/real_models/synthetic.rs` checks against
//! llama.cpp, so that llama.cpp can make its references from the same bytes:
//!
//! ```sh
//! cargo run --release -p model --example synthetic_models -- OUT_DIR
//! ```
//!
//! For each model it writes `OUT_DIR/NAME.gguf` and the prompt to evaluate,
//! `OUT_DIR/NAME.txt`; `tests/data/README.md` has the commands that turn these into the
//! references in `tests/data/oracle`. The generator is the test's own module.

use std::path::PathBuf;

// The generator's modules, at the crate root as in the test binary (they refer to one
// another through `super::`).
#[allow(dead_code)]
#[path = "../tests/real_models/synthetic/generate.rs"]
mod generate;
#[allow(dead_code)]
#[path = "../tests/real_models/synthetic/quantize.rs"]
mod quantize;
#[path = "../tests/real_models/synthetic/vocab.rs"]
mod vocab;

use generate::{build, SPECS};

fn main() {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: synthetic_models OUT_DIR");
        std::process::exit(2);
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("cannot create {}: {e}", dir.display());
        std::process::exit(1);
    }
    for spec in SPECS {
        let bytes = match build(spec) {
            Ok(bytes) => bytes,
            Err(e) => {
                eprintln!("{}: {e}", spec.name);
                std::process::exit(1);
            }
        };
        let gguf = dir.join(format!("{}.gguf", spec.name));
        let prompt = dir.join(format!("{}.txt", spec.name));
        if let Err(e) =
            std::fs::write(&gguf, &bytes).and_then(|()| std::fs::write(&prompt, spec.prompt))
        {
            eprintln!("writing {}: {e}", gguf.display());
            std::process::exit(1);
        }
        println!(
            "{:<16} {:>9} bytes  {}",
            spec.name,
            bytes.len(),
            gguf.display()
        );
    }
}
