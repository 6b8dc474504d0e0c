//! Clause analysis: the copula split of a sentence, and short subject–verb statements rewritten out
//! of long sentences.

use super::lexicon::{
    decap, is_participle, verbish, Lexicon, AUXILIARIES, COMMON_VERBS, NAMING_VERBS, PREPOSITIONS, PRONOUN_SUBJECTS,
};
use super::sentence::{words_of, Sent};
use crate::lift::absorb::qa::words::{is_stopword, strip_final};

/// The sentence's copula ("X is Y") split: (copula word index) when the subject is a real noun
/// phrase (not a pronoun, no leading preposition, no comma) of at most 12 words.
pub(super) fn copula_split(s: &Sent) -> Option<usize> {
    let ws = &s.words;
    let c = ws.iter().position(|w| AUXILIARIES.contains(&w.lower().as_str()))?;
    if c == 0 || c > 12 || c + 1 >= ws.len() {
        return None;
    }
    let subj = s.text(0, c);
    if subj.contains([',', ';', ':', '('])
        || ws[..c].iter().any(|w| w.starts_lower() && COMMON_VERBS.contains(&w.lower().as_str()))
    {
        return None; // "The villagers thought the project was …"
    }
    let first = ws[0].lower();
    if (c == 1 && PRONOUN_SUBJECTS.contains(&first.as_str()))
        || PREPOSITIONS.contains(&first.as_str())
        || first == "there"
    {
        return None;
    }
    if ["when", "if", "while", "although", "because", "as", "after", "before", "since", "once"]
        .contains(&first.as_str())
    {
        return None;
    }
    Some(c)
}

/// The last noun phrase of a comma-separated piece that a following participle or relative clause
/// can attach to: a trailing name run ("… called the Grey Petrel"), else the piece's noun phrase
/// after its last verb or preposition ("… by a ship's carpenter").
fn antecedent(piece: &str, lex: &Lexicon) -> Option<String> {
    let ws = words_of(piece);
    let n = ws.len();
    if n == 0 {
        return None;
    }
    let mut i = n;
    while i > 0 && ws[i - 1].capitalised() && !is_stopword(ws[i - 1].text) {
        i -= 1;
    }
    if i < n && (i > 0 || lex.proper.contains(ws[0].text)) {
        let start = if i > 0 && ws[i - 1].lower() == "the" { i - 1 } else { i };
        return Some(strip_final(&piece[ws[start].raw.0..]).to_string());
    }
    // A bare noun phrase ("The great refractor, installed in 1908, …").
    let determiner = ["the", "a", "an", "this", "its", "their", "his", "her", "our"].contains(&ws[0].lower().as_str());
    (determiner && n <= 8 && !ws.iter().any(verbish)).then(|| decap(strip_final(piece), lex))
}

/// Simple clauses rewritten out of a sentence, so the question rules see short subject–verb
/// statements:
/// - the sentence up to its first comma ("X was Y, a …" → "X was Y"), or whole when it has none;
/// - each coordinated clause (", and the combination … was 7319" → "the combination … was 7319");
/// - a participial phrase with its noun restored ("the Grey Petrel, launched in 1921" → "the Grey
///   Petrel was launched in 1921");
/// - a relative clause with its antecedent ("Ingrid Solberg, who had learned …" → "Ingrid Solberg
///   had learned …");
/// - a possessive-pronoun subject resolved to the previous sentence's last name ("Her hull was …"
///   → "the Grey Petrel's hull was …"), a guess that is right far more often than not in prose.
///
/// Every answer taken from a clause is still verbatim document text; the evidence stays the whole
/// sentence.
pub(super) fn clauses(s: &Sent, lex: &Lexicon, prev_name: Option<&str>) -> Vec<String> {
    let body = strip_final(s.body);
    // Narrative prose is in the past unless the sentence says otherwise.
    let present = s.words.iter().any(|w| matches!(w.lower().as_str(), "is" | "are" | "has" | "have"));
    let past = s.words.iter().any(|w| {
        matches!(w.lower().as_str(), "was" | "were" | "had")
            || (w.starts_lower() && COMMON_VERBS.contains(&w.lower().as_str()))
    });
    let tense = if present && !past { "is" } else { "was" };
    // Comma/semicolon pieces (not the comma inside "1,500").
    // (piece, whether a semicolon precedes it)
    let mut pieces: Vec<(&str, bool)> = Vec::new();
    let (mut start, mut semi) = (0, false);
    for (i, c) in body.char_indices() {
        if (c == ',' || c == ';') && body[i + 1..].starts_with(' ') {
            pieces.push((body[start..i].trim(), semi));
            (start, semi) = (i + 1, c == ';');
        }
    }
    pieces.push((body[start..].trim(), semi));
    let mut out: Vec<String> = Vec::new();
    let has_verb = |t: &str| words_of(t).iter().any(verbish);
    for (k, &(piece, after_semicolon)) in pieces.iter().enumerate() {
        let ws = words_of(piece);
        if ws.len() < 3 {
            continue;
        }
        let first = ws[0].lower();
        let clause = if k == 0 {
            Some(piece.to_string())
        } else if ["and", "but", "while", "yet", "so", "whereas"].contains(&first.as_str()) {
            let rest = piece[ws[1].raw.0..].to_string();
            // "…, and she carried …" / "…, and the combination … was …" (not "…, and generous").
            (words_of(&rest).len() >= 3).then_some(rest)
        } else if ws[0].starts_lower() && is_participle(ws[0].text) && !NAMING_VERBS.contains(&first.as_str()) {
            antecedent(pieces[k - 1].0, lex).map(|a| format!("{a} {tense} {piece}"))
        } else if matches!(first.as_str(), "who" | "which") {
            antecedent(pieces[k - 1].0, lex).map(|a| format!("{a} {}", &piece[ws[1].raw.0..]))
        } else if after_semicolon {
            Some(piece.to_string())
        } else {
            None
        };
        let Some(mut clause) = clause else { continue };
        if !has_verb(&clause) {
            continue;
        }
        // A possessive pronoun subject takes the previous sentence's last name.
        let cw = words_of(&clause);
        if let (Some(name), Some(w0)) = (prev_name, cw.first()) {
            if matches!(w0.lower().as_str(), "her" | "his" | "its" | "their") && cw.len() > 2 {
                clause = format!("{name}'s {}", &clause[cw[1].raw.0..]);
            }
        }
        out.push(clause);
    }
    out
}
