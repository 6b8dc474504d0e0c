//! Differential test of the GGUF-built tokenizer against reference token ids.
//!
//! `fixtures/*_reference.json` hold 400 generated strings (mixed scripts,
//! digits, whitespace runs, contractions, emoji, combining marks, special
//! tokens) with ids from an independent pure-Python byte-level BPE
//! (`fixtures/refgen/refbpe.py`: llama.cpp's pre-tokenizer regexes + the
//! GPT-2 merge loop over the GGUF's own tokens/merges; `corpus.py` made the
//! strings). Each test is skipped when its GGUF is not available.
//!
//! When copied into the main crate, replace `lift_serve::` with that crate's name.

use std::path::PathBuf;

use lift_serve::model::tokenizer::TextTokenizer;

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
}

fn gguf(env: &str, default: &str) -> Option<PathBuf> {
    let path = std::env::var_os(env)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(default));
    if path.exists() {
        Some(path)
    } else {
        eprintln!("skipping: {} not found (set {env})", path.display());
        None
    }
}

fn check(path: PathBuf, fixture: &str, exact_round_trip: bool) {
    let tok = TextTokenizer::from_gguf_file(&path).unwrap();
    let cases: Vec<Case> = serde_json::from_str(fixture).unwrap();
    assert_eq!(cases.len(), 400);
    let mut mismatches = Vec::new();
    for case in &cases {
        let ids = tok.encode(&case.text, false).unwrap();
        if ids != case.ids {
            mismatches.push(format!("{:?}: got {ids:?}, want {:?}", case.text, case.ids));
        }
        let decoded = tok.decode(&ids).unwrap();
        if exact_round_trip {
            assert_eq!(decoded, case.text);
        }
        let mut stream = tok.decode_stream();
        let mut streamed: String = ids
            .iter()
            .filter_map(|&id| stream.push(id).unwrap())
            .collect();
        streamed.extend(stream.flush().unwrap());
        assert_eq!(streamed, decoded, "stream of {:?}", case.text);
    }
    assert!(
        mismatches.is_empty(),
        "{} mismatches:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}

#[test]
fn smollm2_matches_reference_ids() {
    let Some(path) = gguf(
        "LIFT_TEST_GGUF",
        concat!(env!("CARGO_MANIFEST_DIR"), "/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ) else {
        panic!("the default model is missing: run `lift-serve fetch-model`");
    };
    check(path, include_str!("fixtures/smollm2_reference.json"), true);
}

#[test]
fn qwen25_matches_reference_ids() {
    let Some(path) = gguf(
        "LIFT_TEST_QWEN_GGUF",
        concat!(env!("CARGO_MANIFEST_DIR"), "/models/qwen2.5-coder-0.5b-instruct.gguf"),
    ) else {
        return;
    };
    // Qwen2 normalizes to NFC, so decoded text may differ from the input.
    check(path, include_str!("fixtures/qwen25_reference.json"), false);
}

/// `fixtures/tiny-spm.gguf` is an 800-piece SentencePiece BPE model trained
/// with Llama-style options (byte fallback, identity normalization, dummy
/// prefix) by `fixtures/refgen/spm_fixture.py`, stored as a tensor-less GGUF
/// the way llama.cpp converts SentencePiece models; the expected ids come
/// from the `sentencepiece` library encoding with that same model.
#[test]
fn sentencepiece_gguf_matches_sentencepiece() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-spm.gguf");
    let tok = TextTokenizer::from_gguf_file(&path).unwrap();
    let cases: Vec<Case> =
        serde_json::from_str(include_str!("fixtures/tiny_spm_reference.json")).unwrap();
    assert_eq!(cases.len(), 200);
    for case in &cases {
        let ids = tok.encode(&case.text, false).unwrap();
        assert_eq!(ids, case.ids, "{:?}", case.text);
        assert_eq!(tok.decode(&ids).unwrap(), case.text);
        let mut stream = tok.decode_stream();
        let mut streamed: String = ids
            .iter()
            .filter_map(|&id| stream.push(id).unwrap())
            .collect();
        streamed.extend(stream.flush().unwrap());
        assert_eq!(streamed, case.text);
    }
    // BOS handling and user-defined tokens (split out before the space
    // prefix is added, as llama.cpp and HF's legacy Llama tokenizer do).
    assert!(tok.adds_bos());
    assert_eq!(tok.encode("Hello", true).unwrap()[0], 1);
    let user = tok.token_to_id("<|user|>").unwrap();
    let mut expected = vec![user];
    expected.extend(tok.encode("hi there", false).unwrap());
    assert_eq!(tok.encode("<|user|>hi there", false).unwrap(), expected);
    assert_eq!(tok.eos_token_ids(), &[2]);
}
