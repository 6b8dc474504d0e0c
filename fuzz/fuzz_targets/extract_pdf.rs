//! The pdf extraction under the server's default budgets: any input ends in text or a
//! refusal, never a panic, a hang or unbounded memory (libFuzzer's -timeout and -rss_limit_mb).
//! The text extractor (pdf-extract) panics on some malformed files; the extraction contains
//! those (`catch_unwind`: the file's `unreadable_pdf`), so here a panic is a crash only when it
//! escapes: libFuzzer's abort-on-any-panic hook is replaced by one that only prints.
#![no_main]
use libfuzzer_sys::fuzz_target;
#[path = "../../src/formats/mod.rs"]
#[allow(dead_code)]
mod formats;
use formats::{extract_with, Limits};

fuzz_target!(
    init: std::panic::set_hook(Box::new(|info| eprintln!("{info}"))),
    |data: &[u8]| {
        let _ = extract_with(data, Some("t.pdf"), Some("application/pdf"), &Limits::default());
    }
);
