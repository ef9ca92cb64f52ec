//! Small tokenizers for the synthetic models, in the styles of the real families: a
//! byte-level BPE vocabulary (256 byte tokens, a few dozen merges, the family's special
//! tokens and pre-tokenizer name) and a SentencePiece vocabulary with byte fallback
//! (Gemma's layout: control tokens first, then the 256 byte pieces, then scored pieces).
//! A few hundred tokens keep the files small while llama.cpp loads them as it loads any
//! model of the family.

use gguf_format::{GgufError, GgufWriter};

#[path = "../../../../testdata/byte_alphabet.rs"]
mod byte_alphabet;
use byte_alphabet::byte_char;

/// The tokenizer family of a synthetic model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VocabStyle {
    /// SmolLM2: byte-level BPE, pre-tokenizer `smollm`, specials first, no BOS added.
    SmolLm,
    /// Llama 3: byte-level BPE, pre-tokenizer `llama-bpe` (merges ignored for whole
    /// words in the vocabulary), specials last, `<|begin_of_text|>` added.
    Llama3,
    /// Qwen 2: byte-level BPE, pre-tokenizer `qwen2`, specials last, no BOS added.
    Qwen2,
    /// Gemma: SentencePiece with byte fallback and scores, `<bos>` added.
    Gemma,
    /// Phi-3: llama-style SentencePiece (`<unk> <s> </s>`, the byte pieces, scored
    /// pieces, the chat tokens last), `<s>` added, the leading space added.
    Phi3,
}

/// Token types as GGUF stores them.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

/// BPE merges in rank order. Every part is a byte token or the result of an earlier merge.
const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġt", "he"),
    ("r", "e"),
    ("Ġ", "s"),
    ("a", "t"),
    ("Ġ", "w"),
    ("o", "r"),
    ("e", "n"),
    ("Ġ", "c"),
    ("i", "s"),
    ("e", "s"),
    ("Ġ", "o"),
    ("a", "n"),
    ("Ġ", "f"),
    ("Ġ", "b"),
    ("in", "g"),
    ("Ġ", "m"),
    ("Ġ", "d"),
    ("Ġ", "h"),
    ("l", "l"),
    ("o", "u"),
    ("Ġ", "p"),
    ("a", "r"),
    ("Ġ", "l"),
    ("Ġo", "f"),
    ("Ġa", "n"),
    ("Ġan", "d"),
    ("Ċ", "Ċ"),
    ("Ġ", "Ġ"),
    ("ĠĠ", "ĠĠ"),
    ("Ġc", "at"),
    ("Ġs", "at"),
    ("Ġm", "at"),
    ("Ġo", "n"),
    ("s", "er"),
    ("u", "ser"),
];

/// Adds the `tokenizer.ggml.*` keys of `style`; returns the vocabulary size.
pub fn add_tokenizer(w: &mut GgufWriter, style: VocabStyle) -> Result<usize, GgufError> {
    match style {
        VocabStyle::Gemma => add_spm(w),
        VocabStyle::Phi3 => add_phi3_spm(w),
        _ => add_bpe(w, style),
    }
}

fn add_bpe(w: &mut GgufWriter, style: VocabStyle) -> Result<usize, GgufError> {
    let (pre, specials, bos, eos, add_bos): (&str, &[&str], &str, &str, bool) = match style {
        VocabStyle::SmolLm => (
            "smollm",
            &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "<|im_start|>",
            "<|im_end|>",
            false,
        ),
        VocabStyle::Llama3 => (
            "llama-bpe",
            &[
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ],
            "<|begin_of_text|>",
            "<|eot_id|>",
            true,
        ),
        VocabStyle::Qwen2 => (
            "qwen2",
            &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "<|endoftext|>",
            "<|im_end|>",
            false,
        ),
        VocabStyle::Gemma | VocabStyle::Phi3 => {
            unreachable!("SentencePiece vocabularies are built by add_spm and add_phi3_spm")
        }
    };
    let specials_first = style == VocabStyle::SmolLm;
    let mut tokens: Vec<String> = Vec::new();
    let mut types: Vec<i32> = Vec::new();
    let push_specials = |tokens: &mut Vec<String>, types: &mut Vec<i32>| {
        for s in specials {
            tokens.push((*s).to_owned());
            types.push(CONTROL);
        }
    };
    if specials_first {
        push_specials(&mut tokens, &mut types);
    }
    for b in 0..=255u8 {
        tokens.push(byte_char(b).to_string());
        types.push(NORMAL);
    }
    for &(left, right) in MERGES {
        debug_assert!(tokens.iter().any(|t| t == left) && tokens.iter().any(|t| t == right));
        tokens.push(format!("{left}{right}"));
        types.push(NORMAL);
    }
    if !specials_first {
        push_specials(&mut tokens, &mut types);
    }
    let id = |text: &str| {
        tokens
            .iter()
            .position(|t| t == text)
            .expect("special token") as u32
    };
    let (bos_id, eos_id) = (id(bos), id(eos));
    let merges: Vec<String> = MERGES.iter().map(|(l, r)| format!("{l} {r}")).collect();
    let n = tokens.len();
    w.add_metadata("tokenizer.ggml.model", "gpt2")?;
    w.add_metadata("tokenizer.ggml.pre", pre)?;
    w.add_metadata("tokenizer.ggml.tokens", tokens)?;
    w.add_metadata("tokenizer.ggml.token_type", types)?;
    w.add_metadata("tokenizer.ggml.merges", merges)?;
    w.add_metadata("tokenizer.ggml.bos_token_id", bos_id)?;
    w.add_metadata("tokenizer.ggml.eos_token_id", eos_id)?;
    w.add_metadata("tokenizer.ggml.add_bos_token", add_bos)?;
    Ok(n)
}

/// Scored SentencePiece pieces, most likely first.
const PIECES: &[&str] = &[
    "▁", "▁t", "he", "▁the", "in", "▁a", "at", "▁c", "▁s", "▁m", "on", "er", "▁o", "▁on", "▁cat",
    "▁sat", "▁mat", "us", "user", "an", "e", "t", "a", "o", "i", "n", "s", "h", "r", "d", "l", "u",
    "c", "m", "T", ".", ",", "?", "1", "2", "4", "▁i", "▁is", "es",
];

/// Appends the 256 byte pieces, then `pieces` with scores falling with their rank.
fn push_bytes_and_pieces<'a>(
    (tokens, types, scores): (&mut Vec<String>, &mut Vec<i32>, &mut Vec<f32>),
    pieces: impl Iterator<Item = &'a &'a str>,
) {
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(BYTE);
        scores.push(0.0);
    }
    for (rank, piece) in pieces.enumerate() {
        tokens.push((*piece).to_owned());
        types.push(NORMAL);
        scores.push(-(rank as f32));
    }
}

/// Writes a SentencePiece vocabulary (`llama`, `default` pre-tokenizer) with its BOS,
/// EOS, unknown and padding ids, BOS added and EOS not; returns its size.
fn add_spm_metadata(
    w: &mut GgufWriter,
    (tokens, types, scores): (Vec<String>, Vec<i32>, Vec<f32>),
    [bos, eos, unknown, padding]: [u32; 4],
) -> Result<usize, GgufError> {
    let n = tokens.len();
    w.add_metadata("tokenizer.ggml.model", "llama")?;
    w.add_metadata("tokenizer.ggml.pre", "default")?;
    w.add_metadata("tokenizer.ggml.tokens", tokens)?;
    w.add_metadata("tokenizer.ggml.scores", scores)?;
    w.add_metadata("tokenizer.ggml.token_type", types)?;
    let ids = [
        ("bos", bos),
        ("eos", eos),
        ("unknown", unknown),
        ("padding", padding),
    ];
    for (token, id) in ids {
        w.add_metadata(&format!("tokenizer.ggml.{token}_token_id"), id)?;
    }
    w.add_metadata("tokenizer.ggml.add_bos_token", true)?;
    w.add_metadata("tokenizer.ggml.add_eos_token", false)?;
    Ok(n)
}

/// Phi-3's layout: `<unk> <s> </s>`, the 256 byte pieces, the scored pieces, then the
/// end-of-text and chat tokens (user-defined, as its converter writes them).
fn add_phi3_spm(w: &mut GgufWriter) -> Result<usize, GgufError> {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(str::to_owned).to_vec();
    let mut types = vec![UNKNOWN, CONTROL, CONTROL];
    let mut scores = vec![0f32; tokens.len()];
    push_bytes_and_pieces(
        (&mut tokens, &mut types, &mut scores),
        PIECES.iter().chain(&["▁The", "▁Is", "▁it"]),
    );
    let endoftext = tokens.len() as u32;
    tokens.push("<|endoftext|>".to_owned());
    types.push(CONTROL);
    scores.push(0.0);
    for chat in ["<|assistant|>", "<|system|>", "<|end|>", "<|user|>"] {
        tokens.push(chat.to_owned());
        types.push(USER_DEFINED);
        scores.push(0.0);
    }
    add_spm_metadata(w, (tokens, types, scores), [1, endoftext, 0, endoftext])
}

/// Gemma-style SentencePiece: `<pad> <eos> <bos> <unk>`, two turn markers, the 256
/// byte pieces, then pieces whose scores fall with their rank.
fn add_spm(w: &mut GgufWriter) -> Result<usize, GgufError> {
    let mut tokens: Vec<String> = [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<start_of_turn>",
        "<end_of_turn>",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let mut types = vec![CONTROL, CONTROL, CONTROL, UNKNOWN, CONTROL, CONTROL];
    let mut scores = vec![0f32; tokens.len()];
    push_bytes_and_pieces((&mut tokens, &mut types, &mut scores), PIECES.iter());
    let n = add_spm_metadata(w, (tokens, types, scores), [2, 1, 3, 0])?;
    w.add_metadata("tokenizer.ggml.add_space_prefix", false)?;
    Ok(n)
}
