//! The text extraction under the server's default budgets: any input ends in text or a
//! refusal, never a panic, a hang or unbounded memory (libFuzzer's -timeout and -rss_limit_mb).
#![no_main]
use libfuzzer_sys::fuzz_target;
#[path = "../../src/formats/mod.rs"]
#[allow(dead_code)]
mod formats;
use formats::{extract_with, Limits};

fuzz_target!(|data: &[u8]| {
    let _ = extract_with(data, Some("t.txt"), Some("text/plain"), &Limits::default());
});
