//! Parsing the model's reply: `Question: … Answer: … Evidence: …` in the LIFT paper's format and
//! the variants small models write.

use crate::lift::absorb::text::list_marker_len;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Label {
    Question,
    Answer,
    Evidence,
}

/// If `line` starts a labelled field ("Question:", "**Answer:**", "2. Evidence 1:", "Q:"), the
/// label and the rest of the line.
fn label_of(line: &str) -> Option<(Label, &str)> {
    let mut s = line.trim();
    // Leading markdown / list decoration.
    loop {
        let before = s.len();
        s = s.trim_start_matches(['#', '>', '*', '_', '-', '•']).trim_start();
        let m = list_marker_len(s);
        if m > 0 {
            s = s[m..].trim_start();
        }
        if s.len() == before {
            break;
        }
    }
    const NAMES: &[(&str, Label)] = &[
        ("question", Label::Question),
        ("answer", Label::Answer),
        ("evidences", Label::Evidence),
        ("evidence", Label::Evidence),
        ("q", Label::Question),
        ("a", Label::Answer),
    ];
    for &(name, label) in NAMES {
        let Some(head) = s.get(..name.len()) else {
            continue;
        };
        if !head.eq_ignore_ascii_case(name) {
            continue;
        }
        let mut rest = s[name.len()..].trim_start_matches(['*', '_', ' ']);
        if name.len() > 1 {
            rest = rest.trim_start_matches(|c: char| c.is_ascii_digit()).trim_start_matches(['*', '_', ' ']);
        }
        let rest = rest.strip_prefix(':').or_else(|| rest.strip_prefix('：'))?;
        return Some((label, rest.trim_start_matches(['*', '_']).trim()));
    }
    None
}

/// Trims a field: whitespace, markdown bold, a template-style `[...]` wrapper, wrapping quotes.
fn clean_field(s: &str) -> String {
    let mut t = s.trim();
    loop {
        let before = t;
        t = t.trim_matches(['*', '_']).trim();
        if t.starts_with('[') && t.ends_with(']') && t.len() >= 2 {
            t = t[1..t.len() - 1].trim();
        }
        for (a, b) in [('"', '"'), ('“', '”'), ('\'', '\''), ('`', '`')] {
            if t.len() >= 2 && t.starts_with(a) && t.ends_with(b) {
                t = t[a.len_utf8()..t.len() - b.len_utf8()].trim();
            }
        }
        if t == before {
            break;
        }
    }
    let marker = list_marker_len(t);
    t[marker..].split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Parses `Question: … Answer: … Evidence: …` (the paper's format, with or without blank lines,
/// `**Question:**` markdown, leading numbering, content on the next line). Question and answer may
/// continue over following lines up to a blank line or the next label; the evidence is one line.
/// Only the first triple counts. `None` when a field is missing, out of order, empty or still the
/// template placeholder.
pub fn parse_qa(output: &str) -> Option<(String, String, String)> {
    let mut q: Option<String> = None;
    let mut a: Option<String> = None;
    let mut e: Option<String> = None;
    let mut current: Option<Label> = None;
    for raw in output.split('\n') {
        if let Some((label, rest)) = label_of(raw) {
            match label {
                Label::Question if a.is_none() => q = Some(rest.to_string()),
                Label::Answer if q.is_some() && a.is_none() => a = Some(rest.to_string()),
                Label::Evidence if a.is_some() => e = Some(rest.to_string()),
                _ => break,
            }
            current = Some(label);
            if label == Label::Evidence && !rest.is_empty() {
                break;
            }
            continue;
        }
        let line = raw.trim();
        let field = match current {
            Some(Label::Question) => q.as_mut(),
            Some(Label::Answer) => a.as_mut(),
            Some(Label::Evidence) => e.as_mut(),
            None => None,
        };
        let Some(field) = field else { continue };
        if line.is_empty() {
            // A blank line ends a field that has content; an empty field may still get its
            // content on a later line.
            if !field.trim().is_empty() {
                current = None;
            }
            continue;
        }
        if !field.is_empty() {
            field.push(' ');
        }
        field.push_str(line);
        if current == Some(Label::Evidence) {
            break;
        }
    }
    let (q, a, e) = (clean_field(&q?), clean_field(&a?), clean_field(&e?));
    let placeholder = |s: &str, p: &str| s.eq_ignore_ascii_case(p) || s.is_empty();
    if placeholder(&q, "question") || placeholder(&a, "answer") || placeholder(&e, "evidence") {
        return None;
    }
    Some((q, a, e))
}

/// Drops a meta preamble the model repeats before the real question ("What is the answer to the
/// question: Who built it?" → "Who built it?").
pub(super) fn clean_question(q: &str) -> String {
    if let Some(pos) = q.rfind(':') {
        let tail = q[pos + 1..].trim();
        if tail.ends_with('?') && tail.split_whitespace().count() >= 3 && q[..pos].to_lowercase().contains("question") {
            return tail.to_string();
        }
    }
    q.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_paper_format_and_variants() {
        let want = Some((
            "Who founded the museum?".to_string(),
            "Elena Marsh".to_string(),
            "The museum was founded by Elena Marsh.".to_string(),
        ));
        let paper = "Question: Who founded the museum?\n\nAnswer: Elena Marsh\n\nEvidence: The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(paper), want);
        let compact = "Question: Who founded the museum?\nAnswer: Elena Marsh\nEvidence: The museum was founded by Elena Marsh.\n";
        assert_eq!(parse_qa(compact), want);
        let markdown = "Here is a question:\n\n**Question:** Who founded the museum?\n**Answer:** Elena Marsh\n**Evidence:** The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(markdown), want);
        let bold_outside = "**Question**: Who founded the museum?\n**Answer**: Elena Marsh\n**Evidence**: The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(bold_outside), want);
        let numbered = "1. Question: Who founded the museum?\n2. Answer: Elena Marsh\n3. Evidence: The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(numbered), want);
        let next_line = "Question 1:\nWho founded the museum?\n\nAnswer:\nElena Marsh\n\nEvidence:\n\"The museum was founded by Elena Marsh.\"";
        assert_eq!(parse_qa(next_line), want);
        let short_labels =
            "Q: Who founded the museum?\nA: [Elena Marsh]\nEvidence: The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(short_labels), want);
        let lower =
            "question: Who founded the museum?\nanswer: Elena Marsh\nevidence: The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(lower), want);
        // Only the first triple counts.
        let two = format!("{compact}\nQuestion: Another?\nAnswer: x\nEvidence: y");
        assert_eq!(parse_qa(&two), want);
    }

    #[test]
    fn parse_rejects_malformed() {
        assert_eq!(parse_qa(""), None);
        assert_eq!(parse_qa("The museum was founded by Elena Marsh."), None);
        assert_eq!(parse_qa("Question: Who founded the museum?\nAnswer: Elena Marsh"), None);
        assert_eq!(parse_qa("Question: Who founded the museum?\nEvidence: The museum was founded."), None);
        assert_eq!(parse_qa("Answer: Elena Marsh\nEvidence: The museum was founded by Elena Marsh."), None);
        assert_eq!(parse_qa("Question: Who?\nAnswer:\nEvidence: The museum was founded."), None);
        assert_eq!(parse_qa("Question: [question]\n\nAnswer: [answer]\n\nEvidence: [evidence]"), None);
        // Evidence before the answer is out of order.
        assert_eq!(parse_qa("Question: Who?\nEvidence: The museum was founded.\nAnswer: Elena"), None);
    }
}
