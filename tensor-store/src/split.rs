//! Split models: `name-00001-of-00003.gguf` and its siblings open as one model.

use std::path::{Path, PathBuf};

use crate::StoreError;

/// The shard index and count in a file name `…-NNNNN-of-MMMMM.gguf`, with the prefix.
fn split_name(file_name: &str) -> Option<(&str, u32, u32)> {
    let stem = file_name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, index) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(index) || !digits(count) {
        return None;
    }
    let (index, count) = (index.parse().ok()?, count.parse().ok()?);
    (index >= 1 && index <= count).then_some((prefix, index, count))
}

/// The files of the model at `path`: just `path`, or every shard of a split model in order.
pub(crate) fn shard_paths(path: &Path) -> Result<Vec<PathBuf>, StoreError> {
    let Some((prefix, _, count)) = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(split_name)
    else {
        return Ok(vec![path.to_owned()]);
    };
    let dir = path.parent().unwrap_or(Path::new(""));
    (1..=count)
        .map(|index| {
            let shard = dir.join(format!("{prefix}-{index:05}-of-{count:05}.gguf"));
            if shard.exists() {
                Ok(shard)
            } else {
                Err(StoreError::MissingShard {
                    path: path.to_owned(),
                    index,
                    count,
                    missing: shard,
                })
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::split_name;

    #[test]
    fn recognises_split_names() {
        assert_eq!(
            split_name("llama-7b-00002-of-00003.gguf"),
            Some(("llama-7b", 2, 3))
        );
        assert_eq!(split_name("model.gguf"), None);
        assert_eq!(split_name("m-00004-of-00003.gguf"), None);
        assert_eq!(split_name("m-0001-of-00003.gguf"), None);
        assert_eq!(split_name("m-00000-of-00003.gguf"), None);
    }
}
