//! Sentences and words as the extractive rules see them.

use super::lexicon::{is_title, ADVERBS};
use crate::lift::absorb::qa::words::strip_final;
use crate::lift::absorb::text::{list_marker_len, Span};

#[derive(Clone, Debug)]
pub(super) struct Word<'a> {
    /// Byte range of the whole whitespace-delimited token within the body.
    pub(super) raw: (usize, usize),
    /// Byte range of the token without surrounding punctuation.
    pub(super) core: (usize, usize),
    pub(super) text: &'a str,
}

impl Word<'_> {
    pub(super) fn lower(&self) -> String {
        self.text.to_lowercase()
    }
    pub(super) fn capitalised(&self) -> bool {
        self.text.chars().next().is_some_and(char::is_uppercase)
    }
    pub(super) fn starts_lower(&self) -> bool {
        self.text.chars().next().is_some_and(char::is_lowercase)
    }
    pub(super) fn has_digit(&self) -> bool {
        self.text.chars().any(|c| c.is_ascii_digit())
    }
}

pub(super) fn words_of(body: &str) -> Vec<Word<'_>> {
    let mut out = Vec::new();
    let mut i = 0;
    for tok in body.split_whitespace() {
        let start = i + body[i..].find(tok).unwrap_or(0);
        let end = start + tok.len();
        i = end;
        let lead = tok.len()
            - tok.trim_start_matches(|c: char| !c.is_alphanumeric() && c != '$' && c != '£' && c != '€').len();
        let inner = &tok[lead..];
        let mut core = inner.trim_end_matches(|c: char| !c.is_alphanumeric() && c != '%');
        // Possessive 's is not part of the word.
        for suffix in ["'s", "’s"] {
            if let Some(c) = core.strip_suffix(suffix) {
                core = c;
            }
        }
        // Dotted abbreviations keep their final dot ("p.m.", "U.S.").
        let cs = start + lead;
        let mut ce = cs + core.len();
        if core.contains('.') && body[ce..end].starts_with('.') {
            ce += 1;
        }
        if core.is_empty() {
            out.push(Word { raw: (start, end), core: (start, start), text: "" });
        } else {
            out.push(Word { raw: (start, end), core: (cs, ce), text: &body[cs..ce] });
        }
    }
    out
}

/// A sentence prepared for the rules: body (list marker dropped), its words and doc offset.
pub(super) struct Sent<'a> {
    pub(super) body: &'a str,
    pub(super) offset: usize,
    pub(super) words: Vec<Word<'a>>,
}

impl<'a> Sent<'a> {
    pub(super) fn new(doc: &'a str, span: &Span) -> Option<Self> {
        let text = span.text(doc);
        let marker = list_marker_len(text);
        let text2 = &text[marker..];
        let hashes = text2.len() - text2.trim_start_matches(['#', '>']).trim_start().len();
        let lead = marker + hashes;
        let body = &text[lead..];
        let words = words_of(body);
        let n_alpha = words.iter().filter(|w| w.text.chars().any(char::is_alphabetic)).count();
        let punct = strip_final(body).len() < body.trim_end().len();
        // Skip headings, fragments, formulas, code and bibliography entries.
        if words.len() < 4 || n_alpha < 3 || (!punct && words.len() < 6) || words.len() > 80 || hashes > 0 {
            return None;
        }
        let markup =
            body.chars().filter(|c| matches!(c, '$' | '\\' | '{' | '}' | '^' | '=' | '|' | '<' | '>' | '~')).count();
        let letters = body.chars().filter(|c| c.is_alphabetic() || c.is_whitespace()).count();
        let initials = words.iter().filter(|w| {
            let raw = &body[w.raw.0..w.raw.1];
            let mut c = raw.chars();
            matches!((c.next(), c.next()), (Some(a), Some('.')) if a.is_uppercase())
        });
        let lower = body.to_lowercase();
        let bibliography =
            ["arxiv", "doi:", "pp.", "proceedings", "isbn"].iter().any(|k| lower.contains(k)) || body.starts_with('*');
        if markup > 0 || letters * 10 < body.chars().count() * 7 || initials.count() >= 3 || bibliography {
            return None;
        }
        Some(Self { body, offset: span.start + lead, words })
    }

    pub(super) fn text(&self, w0: usize, w1: usize) -> &'a str {
        if w0 >= w1 {
            return "";
        }
        &self.body[self.words[w0].raw.0..self.words[w1 - 1].raw.1]
    }

    /// Text of words `[w0, w1)` without final punctuation.
    pub(super) fn phrase(&self, w0: usize, w1: usize) -> String {
        strip_final(self.text(w0, w1)).to_string()
    }

    /// What follows the core of word `i` in its token (closing punctuation, a possessive 's).
    fn after_core(&self, i: usize) -> &'a str {
        let w = &self.words[i];
        &self.body[w.core.1..w.raw.1]
    }

    /// Whether the raw token of word `i` ends with punctuation that breaks a name run.
    pub(super) fn breaks_after(&self, i: usize) -> bool {
        let after = self.after_core(i).trim_start_matches(['\'', '’']).trim_start_matches('s');
        !(after.is_empty() || (after == "." && is_title(self.words[i].text)))
    }

    pub(super) fn is_possessive(&self, i: usize) -> bool {
        let after = self.after_core(i);
        after.starts_with("'s") || after.starts_with("’s")
    }

    /// The first word after the copula at `c` that is not an adverb ("was *first* opened").
    pub(super) fn predicate_start(&self, c: usize) -> usize {
        let mut p = c + 1;
        while p < self.words.len() && ADVERBS.contains(&self.words[p].lower().as_str()) {
            p += 1;
        }
        p
    }
}
