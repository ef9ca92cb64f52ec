//! What a downloaded file must pass before it is kept: its sha256, and a GGUF header that
//! parses.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use gguf_format::{GgufError, GgufFile};
use sha2::{Digest, Sha256};

/// The header is read in pieces of this size, then as much as the parser asks for.
const FIRST_READ: u64 = 1 << 20;
/// No real header is this large (a 256k vocabulary with merges is tens of MB).
const MAX_HEADER: u64 = 1 << 30;

/// Why a file's header could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

/// A file's sha256, in lower-case hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Parses the header (metadata and tensor infos) of the GGUF file at `path`, reading
/// only as much of it as the header takes.
pub fn gguf_header(path: &Path) -> Result<GgufFile, HeaderError> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut prefix = Vec::new();
    let mut want = FIRST_READ.min(len);
    loop {
        if want > prefix.len() as u64 {
            file.seek(SeekFrom::Start(prefix.len() as u64))?;
            (&mut file)
                .take(want - prefix.len() as u64)
                .read_to_end(&mut prefix)?;
        }
        match gguf_format::parse_prefix(&prefix, len) {
            Err(GgufError::UnexpectedEof { offset, needed, .. })
                if (prefix.len() as u64) < len && prefix.len() as u64 <= MAX_HEADER =>
            {
                // Twice as much at least, so a header of many pieces takes few reads.
                want = offset
                    .saturating_add(needed)
                    .max(2 * prefix.len() as u64)
                    .min(len);
            }
            result => return Ok(result?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sha256_of_a_file_is_hex() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("abc");
        std::fs::write(&path, b"abc").unwrap();
        assert_eq!(
            sha256_file(&path).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_file_that_is_not_gguf_is_said_so() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("page.html");
        std::fs::write(&path, b"<html>not found</html>").unwrap();
        let error = gguf_header(&path).unwrap_err().to_string();
        assert!(error.contains("not a GGUF file"), "{error}");
        std::fs::write(&path, b"GGUF\x03\x00").unwrap();
        let error = gguf_header(&path).unwrap_err().to_string();
        assert!(error.contains("file ends early"), "{error}");
    }
}
