//! A resumable HTTP(S) download into a `.part` file.
//!
//! The file is asked for from where the `.part` file ends (`Range: bytes=N-`): a `206`
//! answer is appended, a `200` (a server without ranges) starts it over, a `416` for a
//! `.part` that already holds the whole file ends the download. A connection that drops
//! mid-file is resumed the same way after a wait, [`PullOptions::retries`] times; after
//! that the `.part` file stays for the next pull. Redirects are followed here rather
//! than by the client, so that headers only the first answer carries (Hugging Face's
//! `X-Linked-Etag`, the sha256 of a large file, and `X-Linked-Size`) are seen.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::path::Path;
use std::time::Duration;

use ureq::http::Response;
use ureq::{Agent, Body};

use super::bar::Bar;
use super::{PullError, PullOptions};

/// Redirects followed before giving up.
const MAX_REDIRECTS: usize = 10;
/// A connection that delivers nothing for this long counts as dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// What the server said the file is, when it said.
#[derive(Debug, Default)]
pub(super) struct Linked {
    pub sha256: Option<String>,
    pub size: Option<u64>,
}

/// How an attempt failed: worth resuming, or not.
enum Failure {
    Dropped(PullError),
    Fatal(PullError),
}

impl From<PullError> for Failure {
    fn from(error: PullError) -> Failure {
        Failure::Fatal(error)
    }
}

/// Downloads `url` into `part`, continuing what `part` already holds.
pub(super) fn download(url: &str, part: &Path, options: &PullOptions) -> Result<Linked, PullError> {
    let agent = agent(url);
    let label = part
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".part").to_owned())
        .unwrap_or_default();
    let mut bar = Bar::new(options.progress, label);
    let mut linked = Linked::default();
    let mut failures = 0u32;
    loop {
        match attempt(&agent, url, part, &mut bar, &mut linked) {
            Ok(()) => {
                bar.finish();
                return Ok(linked);
            }
            Err(Failure::Dropped(error)) if failures < options.retries => {
                failures += 1;
                let delay = options
                    .retry_delay
                    .saturating_mul(1 << (failures - 1).min(16));
                bar.finish();
                eprintln!(
                    "{error}; resuming in {:.0} s (retry {failures} of {})",
                    delay.as_secs_f64(),
                    options.retries
                );
                std::thread::sleep(delay);
            }
            Err(Failure::Dropped(error) | Failure::Fatal(error)) => {
                bar.finish();
                return Err(error);
            }
        }
    }
}

fn agent(url: &str) -> Agent {
    let config = Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .timeout_connect(Some(CONNECT_TIMEOUT))
        .timeout_per_read(Some(READ_TIMEOUT))
        .user_agent(concat!("rocmforge/", env!("CARGO_PKG_VERSION")))
        .accept_encoding("identity");
    // A proxy from the environment (ureq reads HTTPS_PROXY and friends) never stands
    // between us and this machine.
    let config = if is_loopback(url) {
        config.proxy(None)
    } else {
        config
    };
    config.build().new_agent()
}

fn is_loopback(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    host.starts_with("127.") || host.starts_with("localhost") || host.starts_with("[::1]")
}

/// One request and as much of the body as arrives.
fn attempt(
    agent: &Agent,
    url: &str,
    part: &Path,
    bar: &mut Bar,
    linked: &mut Linked,
) -> Result<(), Failure> {
    let mut have = match std::fs::metadata(part) {
        Ok(meta) => meta.len(),
        Err(e) if e.kind() == ErrorKind::NotFound => 0,
        Err(e) => return Err(PullError::io(part, e).into()),
    };
    if have > 0 && !starts_like_gguf(part)? {
        // Not the start of a model: nothing worth continuing.
        std::fs::remove_file(part).map_err(|e| PullError::io(part, e))?;
        have = 0;
    }
    let response = request(agent, url, have, linked)?;
    let status = response.status().as_u16();
    let content_length = header(&response, "content-length").and_then(|v| v.parse::<u64>().ok());
    let (offset, total) = match status {
        200 => (0, content_length),
        206 => {
            let range = header(&response, "content-range").and_then(parse_content_range);
            match range {
                Some((start, total)) if start == have => {
                    (have, total.or(content_length.map(|n| n + have)))
                }
                _ => {
                    return Err(PullError::Http {
                        url: url.to_owned(),
                        reason: format!(
                            "asked for bytes from {have}, the server sent {:?}",
                            header(&response, "content-range").unwrap_or("no Content-Range")
                        ),
                    }
                    .into())
                }
            }
        }
        416 if have > 0 => {
            let total = header(&response, "content-range").and_then(|v| {
                v.strip_prefix("bytes */")
                    .and_then(|t| t.trim().parse::<u64>().ok())
            });
            if total == Some(have) {
                // The `.part` file already holds the whole file.
                return Ok(());
            }
            // Longer than the file: not a part of it. Start over.
            std::fs::remove_file(part).map_err(|e| PullError::io(part, e))?;
            return Err(Failure::Dropped(PullError::Http {
                url: url.to_owned(),
                reason: format!(
                    "the partial download {} does not fit the file",
                    part.display()
                ),
            }));
        }
        _ => {
            let reason = response
                .status()
                .canonical_reason()
                .unwrap_or("")
                .to_owned();
            let failure = PullError::Status {
                url: url.to_owned(),
                status: format!("{status} {reason}").trim_end().to_owned(),
            };
            // A server in trouble may be better in a moment; a missing file will not be.
            return Err(if status >= 500 {
                Failure::Dropped(failure)
            } else {
                Failure::Fatal(failure)
            });
        }
    };
    let mut file = if offset == 0 {
        File::create(part)
    } else {
        OpenOptions::new().append(true).open(part)
    }
    .map_err(|e| PullError::io(part, e))?;
    let mut reader = response.into_body().into_reader();
    let mut done = offset;
    let mut head = Vec::with_capacity(4);
    let mut buf = vec![0u8; 256 << 10];
    bar.start(offset, total);
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if offset == 0 && head.len() < 4 {
            let take = (4 - head.len()).min(n);
            head.extend_from_slice(&buf[..take]);
            if head.len() == 4 {
                if let Err(reason) = check_magic(&head) {
                    drop(file);
                    let _ = std::fs::remove_file(part);
                    return Err(PullError::NotGguf {
                        from: url.to_owned(),
                        reason,
                    }
                    .into());
                }
            }
        }
        if let Err(e) = file.write_all(&buf[..n]) {
            if e.kind() == ErrorKind::StorageFull {
                return Err(PullError::DiskFull {
                    path: part.to_owned(),
                    needed: total.map(|t| t.saturating_sub(done)),
                }
                .into());
            }
            return Err(PullError::io(part, e).into());
        }
        done += n as u64;
        bar.update(done);
    }
    file.sync_data().map_err(|e| PullError::io(part, e))?;
    // A body that ends before its length, or whose reader failed, is a dropped connection.
    let complete = match total {
        Some(total) => done >= total,
        None => true,
    };
    if !complete {
        return Err(Failure::Dropped(PullError::Truncated {
            url: url.to_owned(),
            part: part.to_owned(),
            received: done,
            total,
        }));
    }
    Ok(())
}

/// The answer to a GET from `have` on, after redirects.
fn request(
    agent: &Agent,
    url: &str,
    have: u64,
    linked: &mut Linked,
) -> Result<Response<Body>, Failure> {
    let mut current = url.to_owned();
    for _ in 0..MAX_REDIRECTS {
        let mut request = agent.get(&current);
        if have > 0 {
            request = request.header("Range", format!("bytes={have}-"));
        }
        let response = request.call().map_err(|e| classify(e, url))?;
        if let Some(etag) = header(&response, "x-linked-etag") {
            let etag = etag.trim().trim_start_matches("W/").trim_matches('"');
            if etag.len() == 64 && etag.bytes().all(|b| b.is_ascii_hexdigit()) {
                linked.sha256 = Some(etag.to_ascii_lowercase());
            }
        }
        if let Some(size) = header(&response, "x-linked-size").and_then(|v| v.parse().ok()) {
            linked.size = Some(size);
        }
        if !matches!(response.status().as_u16(), 301 | 302 | 303 | 307 | 308) {
            return Ok(response);
        }
        let Some(location) = header(&response, "location") else {
            return Err(PullError::Http {
                url: url.to_owned(),
                reason: format!("a redirect from {current} without a Location"),
            }
            .into());
        };
        current = join(&current, location);
    }
    Err(PullError::Http {
        url: url.to_owned(),
        reason: format!("more than {MAX_REDIRECTS} redirects"),
    }
    .into())
}

/// A request that got no answer: the network, the name, or the connection.
fn classify(error: ureq::Error, url: &str) -> Failure {
    let unreachable = |reason: String| {
        Failure::Fatal(PullError::Unreachable {
            url: url.to_owned(),
            reason,
        })
    };
    match error {
        ureq::Error::HostNotFound => unreachable("the host name does not resolve".to_owned()),
        ureq::Error::ConnectionFailed => unreachable("the connection failed".to_owned()),
        ureq::Error::Timeout(_) => unreachable(format!("no answer ({error})")),
        ureq::Error::Io(e)
            if matches!(
                e.kind(),
                ErrorKind::ConnectionRefused
                    | ErrorKind::NetworkUnreachable
                    | ErrorKind::HostUnreachable
                    | ErrorKind::NetworkDown
                    | ErrorKind::AddrNotAvailable
                    | ErrorKind::TimedOut
            ) =>
        {
            unreachable(e.to_string())
        }
        // Closed or reset before the answer: try again.
        ureq::Error::Io(e) => Failure::Dropped(PullError::Http {
            url: url.to_owned(),
            reason: format!("the connection failed before an answer ({e})"),
        }),
        other => Failure::Fatal(PullError::Http {
            url: url.to_owned(),
            reason: other.to_string(),
        }),
    }
}

fn header<'r>(response: &'r Response<Body>, name: &str) -> Option<&'r str> {
    response.headers().get(name)?.to_str().ok()
}

/// `bytes START-END/TOTAL` (TOTAL may be `*`): START and TOTAL.
fn parse_content_range(value: &str) -> Option<(u64, Option<u64>)> {
    let rest = value.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (start, _end) = range.split_once('-')?;
    let start = start.trim().parse().ok()?;
    let total = total.trim().parse().ok();
    Some((start, total))
}

/// A redirect's target: absolute, from the host's root, or beside `base`'s path.
fn join(base: &str, location: &str) -> String {
    if location.contains("://") {
        return location.to_owned();
    }
    let (scheme, rest) = base.split_once("://").unwrap_or(("https", base));
    let host = rest.split('/').next().unwrap_or("");
    if let Some(path) = location.strip_prefix("//") {
        return format!("{scheme}://{path}");
    }
    if location.starts_with('/') {
        return format!("{scheme}://{host}{location}");
    }
    let path = rest.split(['?', '#']).next().unwrap_or(rest);
    let dir = path.rsplit_once('/').map_or(path, |(dir, _)| dir);
    format!("{scheme}://{dir}/{location}")
}

/// A GGUF file's first four bytes, or why not.
fn check_magic(head: &[u8]) -> Result<(), String> {
    match gguf_format::parse_prefix(head, u64::MAX) {
        Err(error @ gguf_format::GgufError::BadMagic { .. }) => Err(error.to_string()),
        _ => Ok(()),
    }
}

/// Whether a partial download starts as a GGUF file does (or is too short to tell).
fn starts_like_gguf(part: &Path) -> Result<bool, Failure> {
    let mut head = Vec::with_capacity(4);
    File::open(part)
        .and_then(|f| f.take(4).read_to_end(&mut head))
        .map_err(|e| PullError::io(part, e))?;
    Ok(head.len() < 4 || check_magic(&head).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges_and_redirects_are_read() {
        assert_eq!(
            parse_content_range("bytes 100-199/200"),
            Some((100, Some(200)))
        );
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, None)));
        assert_eq!(parse_content_range("items 1-2/3"), None);
        assert_eq!(
            join("https://a.b/x/y?q=1", "https://c.d/e"),
            "https://c.d/e"
        );
        assert_eq!(join("https://a.b/x/y?q=1", "/z"), "https://a.b/z");
        assert_eq!(join("https://a.b/x/y", "z"), "https://a.b/x/z");
        assert_eq!(join("http://a.b/x", "//c.d/e"), "http://c.d/e");
        assert!(is_loopback("http://127.0.0.1:8080/m.gguf"));
        assert!(is_loopback("http://localhost/m.gguf"));
        assert!(!is_loopback("https://example.org/m.gguf"));
    }

    #[test]
    fn only_gguf_magic_passes() {
        assert!(check_magic(b"GGUF").is_ok());
        let error = check_magic(b"<htm").unwrap_err();
        assert!(error.contains("not a GGUF file"), "{error}");
    }
}
