//! `--devices`, `--split-mode` and `--tensor-split`: what cannot be honoured is refused
//! in one line before the model is read.

use super::{assert_fails_with, run};

#[test]
fn placements_that_cannot_be_honoured_are_refused_in_one_line() {
    for (args, expected) in [
        (
            &["--devices", "0,1", "--split-mode", "none"][..],
            "--split-mode none uses one",
        ),
        (
            &["--split-mode", "tensor"][..],
            "--split-mode tensor needs several GPUs",
        ),
        (
            &[
                "--devices",
                "0,1",
                "--split-mode",
                "tensor",
                "--tensor-split",
                "1,1",
            ][..],
            "--tensor-split applies to --split-mode layer",
        ),
        (
            &["--devices", "0,1", "--tensor-split", "1"][..],
            "--tensor-split gives 1 ratios for 2 devices",
        ),
        (
            &["--tensor-split", "1,1"][..],
            "--tensor-split needs --split-mode layer",
        ),
    ] {
        for command in [
            &["generate", "-m", "no-such-model.gguf", "-p", "hello"][..],
            &["chat", "-m", "no-such-model.gguf"],
            &["load", "-m", "no-such-model.gguf"],
            &["serve", "--gguf", "no-such-model.gguf"],
        ] {
            let all: Vec<&str> = command.iter().chain(args).copied().collect();
            assert_fails_with(&run(&all), expected);
        }
    }
}

#[test]
fn a_bad_split_ratio_is_refused_by_the_argument_parser() {
    let output = run(&[
        "generate",
        "-m",
        "x.gguf",
        "-p",
        "hi",
        "--tensor-split",
        "1,x",
    ]);
    assert!(!output.status.success());
    assert!(!super::stderr(&output).contains("panicked"));
}

#[test]
fn a_server_refuses_split_ratios_that_do_not_match_its_devices() {
    let output = run(&[
        "serve",
        "--gguf",
        "no-such-model.gguf",
        "--devices",
        "0,1",
        "--tensor-split",
        "1,2,3",
    ]);
    assert_fails_with(&output, "--tensor-split gives 3 ratios for 2 devices");
}

#[test]
fn serve_refuses_a_split_by_tensors_before_reading_the_model() {
    let output = run(&[
        "serve",
        "--gguf",
        "no-such-model.gguf",
        "--devices",
        "0,1",
        "--split-mode",
        "tensor",
    ]);
    assert_fails_with(&output, "--split-mode tensor runs one sequence at a time");
}

#[test]
fn copies_of_the_model_are_for_serve_and_one_a_gpu() {
    for command in [
        &["generate", "-m", "no-such-model.gguf", "-p", "hello"][..],
        &["chat", "-m", "no-such-model.gguf"],
        &["load", "-m", "no-such-model.gguf"],
    ] {
        let all: Vec<&str> = command
            .iter()
            .chain(&["--devices", "0,1", "--split-mode", "replicate"])
            .copied()
            .collect();
        assert_fails_with(&run(&all), "--split-mode replicate is for `serve`");
    }
    let serve = [
        "serve",
        "--gguf",
        "no-such-model.gguf",
        "--split-mode",
        "replicate",
    ];
    for (args, expected) in [
        (&["--devices", "0,0"][..], "names a GPU twice"),
        (
            &["--devices", "0,1", "--tensor-split", "1,1"],
            "--tensor-split applies to --split-mode layer",
        ),
    ] {
        let all: Vec<&str> = serve.iter().chain(args).copied().collect();
        assert_fails_with(&run(&all), expected);
    }
    // The server's default over several GPUs checks them too.
    let output = run(&["serve", "--gguf", "no-such-model.gguf", "--devices", "1,1"]);
    assert_fails_with(&output, "names a GPU twice");
}
