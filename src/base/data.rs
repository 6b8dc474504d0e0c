//! Training data for the prepared base (see prepare-base).
//!
//! Placeholder until the data builder (branch `prepared-base`) is merged: it holds only the
//! agreed interface types, so the trainer compiles against them; `build_examples` refuses.

use sha2::{Digest, Sha256};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Validation,
    Eval,
}

#[derive(Clone, Debug)]
pub struct BaseExample {
    /// Sentence-aligned chunks of one long context, in order.
    pub passages: Vec<String>,
    /// Indices of passages holding the supporting facts (never empty).
    pub positive: Vec<usize>,
    pub question: String,
    pub answer: String,
    /// e.g. "single", "two-hop", "distractor".
    pub kind: String,
}

pub fn build_examples(
    _essays_dir: &std::path::Path,
    _split: Split,
    _count: usize,
    _seed: u64,
) -> anyhow::Result<Vec<BaseExample>> {
    anyhow::bail!(
        "the prepared base's training data builder is not in this build yet (src/base/data.rs is a placeholder)"
    )
}

/// SHA-256 (hex, first 16 bytes) of the examples' fields.
pub fn data_hash(examples: &[BaseExample]) -> String {
    let mut h = Sha256::new();
    for e in examples {
        for p in &e.passages {
            h.update(p.as_bytes());
            h.update([0]);
        }
        for i in &e.positive {
            h.update((*i as u64).to_le_bytes());
        }
        for f in [&e.question, &e.answer, &e.kind] {
            h.update(f.as_bytes());
            h.update([1]);
        }
    }
    hex::encode(&h.finalize()[..16])
}
