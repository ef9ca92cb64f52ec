//! What `rocmforge` wrote on stderr.

use std::process::Output;

/// `output`'s stderr, as text.
pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `output`'s stderr contains `text`.
pub fn assert_stderr_has(output: &Output, text: &str) {
    let err = stderr(output);
    assert!(err.contains(text), "{err}");
}
