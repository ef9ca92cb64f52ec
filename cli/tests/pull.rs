//! `rocmforge pull` and `rocmforge list` end to end, against an HTTP server on loopback
//! written here: ranges, a connection dropped mid-file, a wrong checksum, a 404, a body
//! that is not GGUF, redirects carrying Hugging Face's checksum headers, no network.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

#[path = "common/stderr.rs"]
mod stderr;

use stderr::{assert_stderr_has, stderr};

/// A small GGUF file: the header (one metadata entry, no tensors), then bytes enough for
/// a connection to drop in the middle.
fn model_bytes() -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(b"GGUF");
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes()); // tensors
    bytes.extend_from_slice(&1u64.to_le_bytes()); // metadata entries
    let key = b"general.architecture";
    bytes.extend_from_slice(&(key.len() as u64).to_le_bytes());
    bytes.extend_from_slice(key);
    bytes.extend_from_slice(&8u32.to_le_bytes()); // a string
    bytes.extend_from_slice(&5u64.to_le_bytes());
    bytes.extend_from_slice(b"llama");
    bytes.resize(bytes.len().next_multiple_of(32), 0);
    bytes.extend((0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8));
    bytes
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What the server does for a path.
#[derive(Clone)]
enum Route {
    /// The body, honouring `Range: bytes=N-`.
    File(Arc<Vec<u8>>),
    /// As `File`, but the first `drops` answers stop after half of what they promise.
    Flaky(Arc<Vec<u8>>, Arc<Mutex<usize>>),
    /// The whole body with 200, ranges or not.
    NoRanges(Arc<Vec<u8>>),
    /// A redirect, with extra headers.
    Redirect(String, Vec<(String, String)>),
    NotFound,
}

/// A request the server saw: its path and its `Range` header.
type Seen = (String, Option<String>);

/// The server: its address, and the requests it saw.
struct Server {
    base: String,
    requests: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    fn start(routes: HashMap<&'static str, Route>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&requests);
        let routes = Arc::new(routes);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let routes = Arc::clone(&routes);
                let seen = Arc::clone(&seen);
                std::thread::spawn(move || {
                    // A client that went away is no failure of the server.
                    let _ = answer(stream, &routes, &seen);
                });
            }
        });
        Server { base, requests }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn requests(&self) -> Vec<Seen> {
        self.requests.lock().unwrap().clone()
    }
}

fn answer(
    stream: TcpStream,
    routes: &HashMap<&'static str, Route>,
    seen: &Mutex<Vec<Seen>>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let target = line.split_whitespace().nth(1).unwrap_or("/");
    let path = target.split('?').next().unwrap_or(target).to_owned();
    let mut range = None;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("range") {
                range = Some(value.trim().to_owned());
            }
        }
    }
    seen.lock().unwrap().push((path.clone(), range.clone()));
    let mut out = stream;
    let start = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(0);
    match routes
        .get(path.as_str())
        .cloned()
        .unwrap_or(Route::NotFound)
    {
        Route::NotFound => {
            let body = "no such file";
            write!(
                out,
                "HTTP/1.1 404 Not Found\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )?;
        }
        Route::Redirect(to, headers) => {
            write!(out, "HTTP/1.1 302 Found\r\nLocation: {to}\r\n")?;
            for (name, value) in headers {
                write!(out, "{name}: {value}\r\n")?;
            }
            write!(out, "Content-Length: 0\r\nConnection: close\r\n\r\n")?;
        }
        Route::NoRanges(body) => {
            write!(
                out,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )?;
            out.write_all(&body)?;
        }
        Route::File(body) => send_range(&mut out, &body, start, false)?,
        Route::Flaky(body, drops) => {
            let drop_now = {
                let mut drops = drops.lock().unwrap();
                let now = *drops > 0;
                *drops = drops.saturating_sub(1);
                now
            };
            send_range(&mut out, &body, start, drop_now)?;
        }
    }
    out.flush()?;
    out.shutdown(Shutdown::Both)
}

/// `body` from `start` (206 when it is not 0), or half of it and a closed connection.
fn send_range(out: &mut TcpStream, body: &[u8], start: usize, drop: bool) -> std::io::Result<()> {
    if start >= body.len() && start > 0 {
        return write!(
            out,
            "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{}\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n",
            body.len()
        );
    }
    let rest = &body[start..];
    if start == 0 {
        write!(out, "HTTP/1.1 200 OK\r\n")?;
    } else {
        write!(
            out,
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{}/{}\r\n",
            body.len() - 1,
            body.len()
        )?;
    }
    write!(
        out,
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        rest.len()
    )?;
    if drop {
        out.write_all(&rest[..rest.len() / 2])?;
    } else {
        out.write_all(rest)?;
    }
    Ok(())
}

fn rocmforge(models: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rocmforge"));
    command
        .env("ROCMFORGE_MODELS", models)
        .env_remove("ROCMFORGE_OFFLINE");
    command
}

fn pull(models: &Path, args: &[&str]) -> Output {
    rocmforge(models)
        .arg("pull")
        .args(args)
        .output()
        .expect("rocmforge runs")
}

/// Succeeded, printing the model's path on stdout.
fn assert_pulled(output: &Output, path: &Path) {
    let err = stderr(output);
    assert!(output.status.success(), "failed: {err}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        path.display().to_string(),
        "{err}"
    );
}

/// Failed, saying `expected` in its last line, without a panic.
fn assert_fails_with(output: &Output, expected: &str) {
    let err = stderr(output);
    assert!(!output.status.success(), "succeeded: {err}");
    let last = err.trim_end().lines().last().unwrap_or("");
    assert!(last.starts_with("error: "), "{err}");
    assert!(
        last.contains(expected),
        "the error lacks {expected:?}: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Nothing is in `dir`.
fn assert_empty(dir: &Path) {
    let names = files(dir);
    assert!(names.is_empty(), "{names:?}");
}

fn part(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap().to_owned();
    name.push(".part");
    path.with_file_name(name)
}

/// A server of one path.
fn serve_one(path: &'static str, route: Route) -> Server {
    Server::start(HashMap::from([(path, route)]))
}

/// An empty models folder, and the path of `model.gguf` in it.
fn models_folder() -> (tempfile::TempDir, PathBuf) {
    let models = tempfile::tempdir().unwrap();
    let target = models.path().join("model.gguf");
    (models, target)
}

/// A server of `body` at `/model.gguf` whose first answer stops halfway.
fn dropping_once(body: &Arc<Vec<u8>>) -> Server {
    let drops = Arc::new(Mutex::new(1));
    serve_one("/model.gguf", Route::Flaky(body.clone(), drops))
}

#[test]
fn a_model_is_fetched_checked_listed_and_then_present() {
    let body = Arc::new(model_bytes());
    let server = serve_one("/m/model.gguf", Route::File(body.clone()));
    let (models, target) = models_folder();
    let sha = sha256_hex(&body);
    let url = server.url("/m/model.gguf?download=true");
    let output = pull(models.path(), &[&url, "--sha256", &sha]);
    assert_pulled(&output, &target);
    assert_stderr_has(&output, "checksum ok");
    assert_eq!(std::fs::read(&target).unwrap(), *body);
    assert_eq!(files(models.path()), ["model.gguf"]);

    // Already there: not fetched again.
    let again = pull(models.path(), &[&url]);
    assert_pulled(&again, &target);
    assert_stderr_has(&again, "present");
    assert_eq!(server.requests().len(), 1);

    // `--out` puts it elsewhere; `--progress` draws lines off a terminal, on stderr only.
    let elsewhere = models.path().join("sub/renamed.gguf");
    let output = pull(
        models.path(),
        &[&url, "--out", elsewhere.to_str().unwrap(), "--progress"],
    );
    assert_pulled(&output, &elsewhere);
    let err = stderr(&output);
    assert!(err.contains("renamed.gguf 100% ["), "{err}");
    assert!(err.contains(" MB/s"), "{err}");

    let list = rocmforge(models.path()).arg("list").output().unwrap();
    assert!(list.status.success(), "{}", stderr(&list));
    let text = String::from_utf8(list.stdout).unwrap();
    let row = text
        .lines()
        .find(|l| l.starts_with("model.gguf"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(row.contains("300.1 kB") && row.contains("llama"), "{text}");
    let json = rocmforge(models.path())
        .args(["list", "--json"])
        .output()
        .unwrap();
    let rows: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(rows[0]["name"], "model.gguf");
    assert_eq!(rows[0]["size"], body.len());
    assert_eq!(rows[0]["architecture"], "llama");
}

#[test]
fn a_dropped_connection_is_resumed_with_a_range() {
    let body = Arc::new(model_bytes());
    let server = dropping_once(&body);
    let (models, target) = models_folder();
    let output = pull(models.path(), &[&server.url("/model.gguf")]);
    assert_pulled(&output, &target);
    assert_stderr_has(&output, "resuming");
    assert_eq!(std::fs::read(&target).unwrap(), *body);
    let requests = server.requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    assert_eq!(requests[0].1, None);
    assert_eq!(
        requests[1].1.as_deref(),
        Some(format!("bytes={}-", body.len() / 2).as_str())
    );
}

#[test]
fn a_partial_download_stays_and_the_next_pull_finishes_it() {
    let body = Arc::new(model_bytes());
    let server = dropping_once(&body);
    let (models, target) = models_folder();
    let url = server.url("/model.gguf");
    let output = pull(models.path(), &[&url, "--retries", "0"]);
    assert_fails_with(&output, &url);
    assert_fails_with(&output, "pull again to resume");
    assert_eq!(
        std::fs::metadata(part(&target)).unwrap().len(),
        body.len() as u64 / 2
    );
    assert!(!target.exists());
    let list = rocmforge(models.path()).arg("list").output().unwrap();
    assert!(
        String::from_utf8_lossy(&list.stdout).contains("(partial)"),
        "{}",
        String::from_utf8_lossy(&list.stdout)
    );

    let output = pull(models.path(), &[&url, "--sha256", &sha256_hex(&body)]);
    assert_pulled(&output, &target);
    assert_eq!(std::fs::read(&target).unwrap(), *body);
    assert_eq!(files(models.path()), ["model.gguf"]);
    let requests = server.requests();
    assert_eq!(
        requests[1].1.as_deref(),
        Some(format!("bytes={}-", body.len() / 2).as_str())
    );

    // A `.part` file that already holds the whole file is only checked and kept.
    std::fs::rename(&target, part(&target)).unwrap();
    assert_pulled(&pull(models.path(), &[&url]), &target);
    assert_eq!(std::fs::read(&target).unwrap(), *body);
}

#[test]
fn a_server_without_ranges_starts_over() {
    let body = Arc::new(model_bytes());
    let server = serve_one("/model.gguf", Route::NoRanges(body.clone()));
    let (models, target) = models_folder();
    std::fs::write(part(&target), &body[..1000]).unwrap();
    assert_pulled(&pull(models.path(), &[&server.url("/model.gguf")]), &target);
    assert_eq!(std::fs::read(&target).unwrap(), *body);
    assert_eq!(
        server.requests()[0].1.as_deref(),
        Some("bytes=1000-"),
        "the pull asked for the rest"
    );
}

#[test]
fn a_wrong_checksum_removes_the_download() {
    let body = Arc::new(model_bytes());
    let wrong = "0".repeat(64);
    let server = Server::start(HashMap::from([
        ("/model.gguf", Route::File(body.clone())),
        // Hugging Face names a large file's sha256 and size in its redirect.
        (
            "/hub/model.gguf",
            Route::Redirect(
                "/model.gguf".to_owned(),
                vec![
                    (
                        "X-Linked-Etag".to_owned(),
                        format!("\"{}\"", sha256_hex(&body)),
                    ),
                    ("X-Linked-Size".to_owned(), body.len().to_string()),
                ],
            ),
        ),
        (
            "/bad-hub/model.gguf",
            Route::Redirect(
                "/model.gguf".to_owned(),
                vec![("X-Linked-Etag".to_owned(), format!("\"{wrong}\""))],
            ),
        ),
    ]));
    let (models, target) = models_folder();

    let url = server.url("/model.gguf");
    let output = pull(models.path(), &[&url, "--sha256", &wrong]);
    assert_fails_with(&output, &format!("{url}: the download has sha256"));
    assert_fails_with(&output, &format!("expected {wrong}: removed"));
    assert_empty(models.path());

    let output = pull(models.path(), &[&server.url("/bad-hub/model.gguf")]);
    assert_fails_with(&output, "sha256");
    assert_empty(models.path());

    let output = pull(models.path(), &[&server.url("/hub/model.gguf")]);
    assert_pulled(&output, &target);
    assert_stderr_has(&output, "checksum ok");
}

#[test]
fn a_404_a_page_and_no_network_are_said_plainly() {
    let page = Arc::new(b"<!doctype html><title>Sign in</title>".repeat(100));
    let server = serve_one("/page.gguf", Route::File(page));
    let models = tempfile::tempdir().unwrap();

    let missing = server.url("/missing.gguf");
    let output = pull(models.path(), &[&missing]);
    assert_fails_with(
        &output,
        &format!("{missing}: the server answered 404 Not Found"),
    );

    let page = server.url("/page.gguf");
    let output = pull(models.path(), &[&page]);
    assert_fails_with(&output, &format!("{page}: not a GGUF model"));
    assert_fails_with(&output, "removed");
    assert_empty(models.path());

    // A port nothing listens on.
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{closed}/model.gguf");
    let output = pull(models.path(), &[&url]);
    assert_fails_with(&output, &format!("cannot reach {url}"));
    assert_fails_with(&output, "is the network up?");

    let output = pull(models.path(), &["hf://only-a-repo"]);
    assert_fails_with(&output, "expected hf://ORG/REPO/FILE.gguf");
    let output = pull(models.path(), &[&server.url("/dir/")]);
    assert_fails_with(&output, "--out FILE");
    assert_empty(models.path());
}

#[test]
fn offline_nothing_is_downloaded() {
    let body = Arc::new(model_bytes());
    let server = serve_one("/model.gguf", Route::File(body));
    let models = tempfile::tempdir().unwrap();
    let url = server.url("/model.gguf");
    let output = rocmforge(models.path())
        .args(["pull", &url])
        .env("ROCMFORGE_OFFLINE", "1")
        .output()
        .unwrap();
    assert_fails_with(&output, "downloads are off");
    let output = pull(models.path(), &[&url, "--offline"]);
    assert_fails_with(&output, "downloads are off");
    assert!(server.requests().is_empty());

    // Without the default model, offline, the commands that would fetch it say how to.
    for args in [
        &["generate", "--prompt", "hi"][..],
        &["chat"][..],
        &["serve", "--port", "0"][..],
    ] {
        let output = rocmforge(models.path())
            .args(args)
            .env("ROCMFORGE_OFFLINE", "1")
            .output()
            .unwrap();
        let path = models.path().join("SmolLM2-135M-Instruct.Q4_1.gguf");
        assert_fails_with(&output, path.to_str().unwrap());
        assert_fails_with(&output, "`rocmforge pull`");
    }
    assert_empty(models.path());
}
