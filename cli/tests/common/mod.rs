//! Running `rocmforge` with piped streams, and Ctrl-C: it is sent SIGINT, as a terminal
//! sends it, and must then exit promptly.

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// Starts `command` with its stdin, stdout and stderr piped.
pub fn spawn_piped(command: &mut Command) -> Child {
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rocmforge starts")
}

/// Runs `command` with `stdin` as its input.
pub fn run_piped(command: &mut Command, stdin: &[u8]) -> Output {
    let mut child = spawn_piped(command);
    let mut input = child.stdin.take().unwrap();
    let bytes = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        // The program may exit before reading everything (an error): that is its answer.
        let _ = input.write_all(&bytes);
    });
    let output = child.wait_with_output().unwrap();
    writer.join().unwrap();
    output
}

/// Sends SIGINT to `child`.
pub fn ctrl_c(child: &Child) {
    let interrupt = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupt.success());
}

/// Waits for `child` to exit, which must take less than 30 seconds.
pub fn wait_briefly(child: &mut Child) -> ExitStatus {
    let start = Instant::now();
    let status = child.wait().unwrap();
    assert!(start.elapsed() < Duration::from_secs(30));
    status
}

/// The rest of `child`'s piped stderr.
pub fn read_stderr(child: &mut Child) -> String {
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    err
}
