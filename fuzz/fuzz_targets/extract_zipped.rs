//! The ZIP-packaged formats (Word .docx, OpenDocument .odt, EPUB) under the server's default
//! budgets: every input, read as each of the three, ends in text or a refusal, never a panic, a
//! hang or unbounded memory.
#![no_main]
use libfuzzer_sys::fuzz_target;
#[path = "../../src/formats/mod.rs"]
#[allow(dead_code)]
mod formats;
use formats::{extract_with, Limits};

fuzz_target!(|data: &[u8]| {
    for name in ["t.docx", "t.odt", "t.epub"] {
        let _ = extract_with(data, Some(name), None, &Limits::default());
    }
});
