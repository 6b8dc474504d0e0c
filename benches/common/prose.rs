//! Prose documents of a given length for the benches, from the repository's fixtures.

use lift_serve::model::Model;

const SOURCES: &[&str] =
    &[include_str!("../../tests/fixtures/kestrel_observatory.txt"), include_str!("../../tests/fixtures/harbor_history.txt")];

/// Prose of at least `tokens` tokens, ended at a paragraph or sentence boundary.
pub fn document(model: &Model, tokens: usize) -> anyhow::Result<String> {
    let mut text = String::new();
    let mut chapter = 1;
    'outer: loop {
        for src in SOURCES {
            for para in src.split("\n\n") {
                let para = para.trim();
                if para.is_empty() {
                    continue;
                }
                text.push_str(&format!("Chapter {chapter}. {para}\n\n"));
                chapter += 1;
                if model.tokenizer.encode(&text, false)?.len() >= tokens {
                    break 'outer;
                }
            }
        }
    }
    // Trim sentences back to just over the target.
    while let Some(cut) = text.trim_end().rfind(". ") {
        let shorter = &text[..cut + 1];
        if model.tokenizer.encode(shorter, false)?.len() < tokens {
            break;
        }
        text.truncate(cut + 1);
    }
    Ok(text)
}

