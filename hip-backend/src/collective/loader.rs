//! The dynamic loader: open a shared library by name or path (`dlopen`), look up its
//! symbols (`dlsym`), and say which file it was (`dladdr`).

use std::ffi::{c_char, c_void, CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// An open shared library. It is opened with `RTLD_NODELETE`: closing the handle never
/// unmaps the library, whose threads, exit handlers and registered device code (NCCL's
/// proxy threads, its copy of the CUDA runtime) may outlive the last handle.
pub(crate) struct Library {
    handle: *mut c_void,
}

// SAFETY: a `dlopen` handle is a process-wide token; `dlsym` and `dlclose` may be called on
// it from any thread.
unsafe impl Send for Library {}
// SAFETY: as above; the only shared use is `dlsym`, which is thread-safe.
unsafe impl Sync for Library {}

/// The text of the loader's last error on this thread (`dlerror`), or `fallback`.
fn last_error(fallback: &str) -> String {
    // SAFETY: `dlerror` returns null or a NUL-terminated string that stays valid until the
    // next loader call on this thread; it is copied at once.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        return fallback.to_owned();
    }
    // SAFETY: non-null and NUL-terminated, as `dlerror` promises.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

impl Library {
    /// Opens `name` (a path, or a file name without `/` for the loader's search path),
    /// resolving every symbol at once and keeping them out of the global namespace. The
    /// error is the loader's text, which names the library.
    pub(crate) fn open(name: &Path) -> Result<Library, String> {
        let c_name = CString::new(name.as_os_str().as_bytes()).map_err(|_| {
            format!(
                "{}: a library path cannot contain a NUL byte",
                name.display()
            )
        })?;
        // SAFETY: `c_name` is a NUL-terminated string alive for the call. Opening a library
        // runs its initialisers, which is what loading it means.
        let handle = unsafe {
            libc::dlopen(
                c_name.as_ptr(),
                libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE,
            )
        };
        if handle.is_null() {
            Err(last_error(&format!("{}: dlopen failed", name.display())))
        } else {
            Ok(Library { handle })
        }
    }

    /// The address of symbol `name`; the error names it and carries the loader's text.
    pub(crate) fn symbol(&self, name: &str) -> Result<*mut c_void, String> {
        let c_name = CString::new(name).map_err(|_| format!("bad symbol name {name:?}"))?;
        // SAFETY: clears any earlier error, so the text read below is this lookup's.
        unsafe { libc::dlerror() };
        // SAFETY: `self.handle` is open until `Drop`; `c_name` is NUL-terminated.
        let address = unsafe { libc::dlsym(self.handle, c_name.as_ptr()) };
        if address.is_null() {
            Err(format!(
                "symbol {name} not found: {}",
                last_error("no such symbol")
            ))
        } else {
            Ok(address)
        }
    }

    /// The file the loader mapped for the library that holds `address` (a symbol of this
    /// library), as `dladdr` reports it: a full path when the library was found through the
    /// search path.
    pub(crate) fn file_of(&self, address: *const c_void) -> Option<String> {
        let mut info = libc::Dl_info {
            dli_fname: std::ptr::null(),
            dli_fbase: std::ptr::null_mut(),
            dli_sname: std::ptr::null(),
            dli_saddr: std::ptr::null_mut(),
        };
        // SAFETY: `info` is a live local `dladdr` fills; `address` is only compared with the
        // loaded objects' ranges, never dereferenced.
        let found = unsafe { libc::dladdr(address, &mut info) };
        let file: *const c_char = info.dli_fname;
        if found == 0 || file.is_null() {
            return None;
        }
        // SAFETY: non-null `dli_fname` is the NUL-terminated name of a loaded object, which
        // stays loaded (this library is never unmapped).
        let file = unsafe { CStr::from_ptr(file) }.to_string_lossy();
        (!file.is_empty()).then(|| file.into_owned())
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: our own handle, closed once. With RTLD_NODELETE this only drops the
        // reference; a failure leaves nothing to undo, so it is ignored.
        let _ = unsafe { libc::dlclose(self.handle) };
    }
}

/// Opens the first of `candidates` that loads, and says which it was. The error lists the
/// loader's text for each one tried, in order.
pub(crate) fn open_first(candidates: &[PathBuf]) -> Result<(Library, PathBuf), Vec<String>> {
    let mut failures = Vec::with_capacity(candidates.len());
    for name in candidates {
        match Library::open(name) {
            Ok(library) => return Ok((library, name.clone())),
            Err(text) => failures.push(text),
        }
    }
    Err(failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_fails_with_the_loaders_text() {
        let missing = PathBuf::from("/nonexistent/librocmforge-missing.so");
        let failures = match open_first(std::slice::from_ref(&missing)) {
            Err(failures) => failures,
            Ok(_) => panic!("{} loaded", missing.display()),
        };
        assert_eq!(failures.len(), 1);
        assert!(
            failures[0].contains("/nonexistent/librocmforge-missing.so"),
            "{failures:?}"
        );
        assert!(matches!(open_first(&[]), Err(f) if f.is_empty()));
    }

    #[test]
    fn symbols_are_found_and_missing_ones_named() {
        // The C library is always loaded; opening it again only takes a reference.
        let library = Library::open(Path::new("libc.so.6")).expect("libc");
        let strlen = library.symbol("strlen").expect("strlen");
        assert!(!strlen.is_null());
        let file = library.file_of(strlen).expect("dladdr");
        assert!(file.contains("libc"), "{file}");
        let missing = library
            .symbol("rocmforge_no_such_symbol")
            .expect_err("a missing symbol");
        assert!(missing.contains("rocmforge_no_such_symbol"), "{missing}");
        let nul = std::ffi::OsStr::from_bytes(b"bad\0name");
        assert!(Library::open(Path::new(nul)).is_err());
    }
}
