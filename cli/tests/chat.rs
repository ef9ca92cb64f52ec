//! `rocmforge chat` end to end on SmolLM2, driven through piped stdin: the first answer
//! is `generate --chat`'s, a later turn sees the earlier ones and processes only its own
//! tokens, `/clear` forgets, `/save` and `/load` keep a conversation, Ctrl-C stops an
//! answer and not the program. The model comes from `cargo xtask fetch-models` (or
//! `rocmforge pull`); these tests fail, saying so, when it is missing.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
#[path = "../../testdata/models.rs"]
mod models;

use common::{ctrl_c, read_stderr, run_piped, spawn_piped, wait_briefly};

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn model() -> PathBuf {
    models::model_path(SMOLLM2)
}

fn rocmforge() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rocmforge"));
    // A model given on the command line is never fetched; nothing else should be either.
    command.env("ROCMFORGE_OFFLINE", "1");
    command
}

/// `chat` on `model`, greedy, answers of at most `max_tokens`.
fn chat_command(model: &Path, max_tokens: &str) -> Command {
    let mut command = rocmforge();
    command
        .args(["chat", "--gguf", model.to_str().unwrap()])
        .args(["--temperature", "0", "--max-tokens", max_tokens]);
    command
}

/// `chat` on SmolLM2, greedy, with `input` on stdin and the `info` log on stderr.
fn chat(model: &Path, extra: &[&str], input: &str) -> Output {
    let mut command = chat_command(model, "40");
    command.args(extra).env("ROCMFORGE_LOG", "info");
    run_piped(&mut command, input.as_bytes())
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The `(reused, new)` token counts of each turn, from the `info` log.
fn turns(log: &str) -> Vec<(usize, usize)> {
    let field = |line: &str, name: &str| -> usize {
        let start = line.find(&format!(" {name}=")).expect("the field") + name.len() + 2;
        line[start..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    log.lines()
        .filter(|l| l.contains("rocmforge::chat: turn "))
        .map(|l| (field(l, "reused"), field(l, "new")))
        .collect()
}

/// The messages of a conversation saved with `/save`.
fn saved(path: &Path) -> Vec<(String, String)> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_owned(),
                m["content"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[test]
fn the_first_answer_is_generate_chats() {
    let model = model();
    let question = "What is the capital of France?";
    let generated = rocmforge()
        .args(["generate", "--chat", "--gguf", model.to_str().unwrap()])
        .args([
            "--temperature",
            "0",
            "--max-tokens",
            "40",
            "--prompt",
            question,
        ])
        .output()
        .unwrap();
    assert!(generated.status.success(), "{}", stderr(&generated));
    let chatted = chat(&model, &[], &format!("{question}\n"));
    assert!(chatted.status.success(), "{}", stderr(&chatted));
    assert_eq!(
        String::from_utf8(chatted.stdout).unwrap(),
        String::from_utf8(generated.stdout).unwrap()
    );
}

#[test]
fn later_turns_see_earlier_ones_until_clear() {
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let (after_two, after_clear) = (dir.path().join("two.json"), dir.path().join("one.json"));
    let input = format!(
        "The password is BLUEBIRD.\nWhat is the password?\n/save {}\n/clear\n\
         What is the password?\n/save {}\n",
        after_two.display(),
        after_clear.display()
    );
    let output = chat(&model, &[], &input);
    let log = stderr(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("(conversation cleared)"), "{log}");

    let two = saved(&after_two);
    let roles: Vec<&str> = two.iter().map(|(role, _)| role.as_str()).collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    assert!(
        two[3].1.contains("BLUEBIRD"),
        "the second answer: {:?}",
        two[3].1
    );
    let one = saved(&after_clear);
    assert_eq!(one.len(), 2);
    assert!(
        !one[1].1.contains("BLUEBIRD"),
        "after /clear: {:?}",
        one[1].1
    );

    // The second turn processes only its own tokens; after /clear everything is new.
    let turns = turns(&log);
    assert_eq!(turns.len(), 3, "{log}");
    let (first, second, third) = (turns[0], turns[1], turns[2]);
    assert_eq!(first.0, 0);
    assert!(second.0 > first.1, "{turns:?}");
    assert!(second.1 < 25, "{turns:?}");
    assert_eq!(third.0, 0, "{turns:?}");
}

#[test]
fn a_system_message_and_a_loaded_conversation_are_rendered() {
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (dir.path().join("a.json"), dir.path().join("b.json"));
    let input = format!(
        "Hello!\n/save {}\n/clear\n/load {}\nAnd again: hello!\n/save {}\n/load {}\n",
        first.display(),
        first.display(),
        second.display(),
        dir.path().join("missing.json").display()
    );
    let output = chat(&model, &["--system", "You are terse."], &input);
    let log = stderr(&output);
    let a = saved(&first);
    assert_eq!(a[0], ("system".to_owned(), "You are terse.".to_owned()));
    assert_eq!(a[1], ("user".to_owned(), "Hello!".to_owned()));
    let b = saved(&second);
    assert_eq!(b.len(), 5);
    assert_eq!(b[..3], a[..]);
    // After /clear the loaded conversation is processed whole.
    let turns = turns(&log);
    assert_eq!(turns[1].0, 0, "{turns:?}");
    // A file that is not there is an error on stderr; piped, the run then fails.
    assert!(log.contains("missing.json"), "{log}");
    assert!(!output.status.success(), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn ctrl_c_stops_the_answer_not_the_chat() {
    let model = model();
    let mut child = spawn_piped(&mut chat_command(&model, "300"));
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(b"Write a very long story about a dragon.\n")
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).expect("the answer streams");
    ctrl_c(&child);
    // The next message is answered, then the end of the input ends the chat.
    stdin
        .write_all(b"/system Answer in one word.\nThanks!\n")
        .unwrap();
    drop(stdin);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let status = wait_briefly(&mut child);
    let err = read_stderr(&mut child);
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(err.contains("[answer stopped]"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let text = String::from_utf8([&first[..], &rest].concat()).unwrap();
    // The stopped answer's line, then the second answer's.
    assert!(text.lines().count() >= 2, "{text:?}");
}
