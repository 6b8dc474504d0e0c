//! Sentence and paragraph splitting for prose, as byte spans into the original text.
//!
//! Spans are trimmed (they start and end on non-whitespace), never empty, in order, disjoint, and
//! together cover every non-whitespace character of the text. Boundaries:
//! - a blank line always ends a sentence (paragraph break);
//! - a single newline ends a sentence when a heading or list item starts or ends there, or when the
//!   line before is short and unpunctuated (titles, verse, addresses); soft-wrapped prose lines
//!   (a long line, or a next line starting in lower case) are joined;
//! - `.`, `!`, `?`, `…` (runs such as `?!` or `...`), followed by closing quotes/brackets and
//!   whitespace, end a sentence unless the next word starts in lower case, the `.` ends a known
//!   abbreviation (Mr., Dr., e.g., U.S., No. 5), an initial (J. K. Rowling), or a list number
//!   (`1.` at the start of a line), or an ellipsis is followed by anything but a capital.
//!
//! Decimals (3.14), versions and dotted acronyms have no whitespace after the inner dots and are
//! never split. Very long runs without punctuation are cut at whitespace every
//! [`MAX_SENTENCE_BYTES`] so one "sentence" cannot swallow a whole document.

/// A byte range `[start, end)` into a text, always on char boundaries.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn new(start: usize, end: usize) -> Self {
        Self { start, end }
    }

    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }

    /// The spanned text.
    pub fn text<'a>(&self, text: &'a str) -> &'a str {
        &text[self.start..self.end]
    }
}

/// Longest sentence kept whole; longer unpunctuated runs are cut at whitespace.
pub const MAX_SENTENCE_BYTES: usize = 1000;

/// Lines shorter than this (trimmed, in chars) that lack final punctuation end a sentence at
/// their newline (headings, titles, verse); longer ones are treated as soft-wrapped prose.
const SHORT_LINE_CHARS: usize = 40;

const TERMINATORS: &[char] = &['.', '!', '?', '…', '。', '！', '？'];
const CLOSERS: &[char] = &['"', '\'', '”', '’', ')', ']', '}', '»', '›', '*', '_', '`'];

/// Abbreviations after which a `.` never ends a sentence (compared lower-case, inner dots kept).
const ABBREVIATIONS: &[&str] = &[
    "mr", "mrs", "ms", "mx", "dr", "prof", "sr", "jr", "st", "mt", "ft", "gen", "col", "lt", "sgt", "capt", "cpt",
    "cmdr", "adm", "maj", "rev", "hon", "gov", "sen", "rep", "pres", "supt", "insp", "messrs", "mme", "mlle", "fr",
    "vs", "cf", "e.g", "i.e", "viz", "approx", "ca", "et al", "al", "dept", "univ", "assn", "bros", "est", "ave",
    "blvd", "rd", "hwy", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "u.s",
    "u.k", "u.n", "e.u", "d.c", "ph.d", "m.d", "b.a", "m.a", "b.sc", "m.sc", "op", "cit", "ibid", "resp", "incl",
];

/// Abbreviations that only hold before a number ("No. 5", "Fig. 3", "p. 12").
const NUMBER_ABBREVIATIONS: &[&str] =
    &["no", "nos", "fig", "figs", "vol", "vols", "p", "pp", "ch", "art", "sec", "eq", "ref", "tab", "nr"];

/// Characters that draw boxes and rules in plain-text documents (disclaimers in a box of `*`,
/// headings underlined with `-` or `=`, ASCII tables' `+---+` edges).
const RULE_CHARS: &[char] = &['*', '-', '=', '_', '~', '+', '#', '|'];

/// The text with its drawing blanked: rule lines (a line of at least four rule characters and
/// nothing else) and the left and right borders of boxed lines (`*  text  *`, `|  text  |`, on at
/// least two consecutive lines) become spaces. The result has the same length in bytes and
/// the same line breaks, so every span of it is a span of the original: sentences are cut from
/// the normalized text and their evidence read from the original. A boxed paragraph then
/// reads as the prose it is (one sentence across its lines), and a rule ends a paragraph.
pub fn normalize_layout(text: &str) -> String {
    let ls = lines(text);
    let mut out = text.as_bytes().to_vec();
    let blank = |out: &mut Vec<u8>, s: usize, e: usize| out[s..e].iter_mut().for_each(|b| *b = b' ');
    // (left border byte, right border byte) of each line that has both.
    let borders: Vec<Option<(usize, usize)>> = ls.iter().map(|&(s, e)| box_borders(text, s, e)).collect();
    for (k, &(s, e)) in ls.iter().enumerate() {
        let line = text[s..e].trim();
        if is_rule_line(line) {
            blank(&mut out, s, e);
            continue;
        }
        let Some((l, r)) = borders[k] else { continue };
        let same = |j: Option<usize>| {
            j.and_then(|j| borders.get(j).copied().flatten()).is_some_and(|(l2, _)| text.as_bytes()[l2] == text.as_bytes()[l])
                || j.and_then(|j| ls.get(j)).is_some_and(|&(s2, e2)| is_rule_line(text[s2..e2].trim()))
        };
        if same(k.checked_sub(1)) || same(Some(k + 1)) {
            blank(&mut out, l, l + 1);
            blank(&mut out, r, r + 1);
        }
    }
    // Only ASCII bytes were replaced by spaces: still UTF-8.
    String::from_utf8(out).expect("ASCII replaced by ASCII")
}

/// A line that only draws: four or more rule characters (spaces between allowed).
fn is_rule_line(line: &str) -> bool {
    line.chars().filter(|c| !c.is_whitespace()).count() >= 4 && line.chars().all(|c| c.is_whitespace() || RULE_CHARS.contains(&c))
}

/// The byte offsets of a boxed line's two borders: the same character (`*`, `|` or `#`) first and
/// last on the line, each set off by a space from the text between (or the line holds only them);
/// a `|` line with another `|` inside is a table row, not a box.
fn box_borders(text: &str, s: usize, e: usize) -> Option<(usize, usize)> {
    let line = &text[s..e];
    let lead = line.len() - line.trim_start().len();
    let trimmed = line.trim();
    let c = trimmed.chars().next()?;
    if !matches!(c, '*' | '|' | '#') || trimmed.len() < 2 || !trimmed.ends_with(c) {
        return None;
    }
    let inner = &trimmed[1..trimmed.len() - 1];
    let set_off = inner.is_empty() || inner.trim().is_empty() || (inner.starts_with(' ') && inner.ends_with(' '));
    if !set_off || (c == '|' && inner.contains('|')) {
        return None;
    }
    let l = s + lead;
    Some((l, l + trimmed.len() - 1))
}

/// Splits prose into sentences (see the module docs).
pub fn split_sentences(text: &str) -> Vec<Span> {
    let mut out = Vec::new();
    for block in blocks(text) {
        split_block(text, block, &mut out);
    }
    let mut capped = Vec::with_capacity(out.len());
    for s in out {
        cap_length(text, s, &mut capped);
    }
    capped
}

/// Splits text into paragraphs separated by blank (whitespace-only) lines; spans are trimmed.
pub fn split_paragraphs(text: &str) -> Vec<Span> {
    let mut out = Vec::new();
    let mut cur: Option<Span> = None;
    for (start, end) in lines(text) {
        let line = &text[start..end];
        if line.trim().is_empty() {
            if let Some(p) = cur.take() {
                out.push(p);
            }
            continue;
        }
        let s = start + (line.len() - line.trim_start().len());
        let e = start + line.trim_end().len();
        match cur.as_mut() {
            Some(p) => p.end = e,
            None => cur = Some(Span::new(s, e)),
        }
    }
    out.extend(cur);
    out
}

/// Byte ranges of the lines of `text`, without their line terminators.
fn lines(text: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if c == '\n' {
            let end = if i > start && text.as_bytes()[i - 1] == b'\r' { i - 1 } else { i };
            out.push((start, end));
            start = i + 1;
        }
    }
    if start < text.len() {
        out.push((start, text.len()));
    }
    out
}

/// Whether a (trimmed) line starts with a list or heading marker.
pub fn is_list_or_heading(line: &str) -> bool {
    list_marker_len(line) > 0 || line.starts_with('#') || line.starts_with('>') || line.starts_with('|')
}

/// Length in bytes of a leading list marker ("- ", "* ", "• ", "1. ", "2) ", "(a) ", "a. "),
/// including the whitespace after it; 0 when there is none.
pub fn list_marker_len(line: &str) -> usize {
    let b = line.as_bytes();
    let after_ws = |i: usize| -> usize {
        let rest = &line[i..];
        if rest.is_empty() {
            return 0;
        }
        let ws = rest.len() - rest.trim_start().len();
        if ws == 0 {
            0
        } else {
            i + ws
        }
    };
    if let Some(c) = line.chars().next() {
        if matches!(c, '-' | '*' | '+' | '•' | '–' | '—' | '·' | '▪' | '◦') {
            return after_ws(c.len_utf8());
        }
    }
    // "12." / "12)" / "a." / "a)" / "(a)" / "(12)"
    let mut i = 0;
    let paren = b.first() == Some(&b'(');
    if paren {
        i = 1;
    }
    let digits = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
    let letter = digits == 0 && b.len() > i + 1 && b[i].is_ascii_lowercase() && !b[i + 1].is_ascii_alphabetic();
    let body = if digits > 0 && digits <= 3 {
        digits
    } else if letter {
        1
    } else {
        return 0;
    };
    i += body;
    match b.get(i) {
        Some(b')') => after_ws(i + 1),
        Some(b'.') if !paren => after_ws(i + 1),
        _ => 0,
    }
}

fn ends_with_terminal(line: &str) -> bool {
    let t = line.trim_end_matches(CLOSERS);
    t.ends_with(TERMINATORS) || t.ends_with(':') || t.ends_with(';')
}

/// Groups lines into blocks that no sentence crosses.
fn blocks(text: &str) -> Vec<(usize, usize)> {
    let ls = lines(text);
    let mut out = Vec::new();
    let mut cur: Option<(usize, usize)> = None;
    let mut prev_line: Option<&str> = None;
    for (start, end) in ls {
        let line = text[start..end].trim();
        if line.is_empty() {
            out.extend(cur.take());
            prev_line = None;
            continue;
        }
        let join = match (cur, prev_line) {
            (Some(_), Some(prev)) => soft_wrap(prev, line),
            _ => false,
        };
        if join {
            if let Some(c) = cur.as_mut() {
                c.1 = end;
            }
        } else {
            out.extend(cur.take());
            cur = Some((start, end));
        }
        prev_line = Some(line);
    }
    out.extend(cur);
    out
}

/// Whether the newline between two non-blank (trimmed) lines is a soft wrap inside a sentence.
fn soft_wrap(prev: &str, next: &str) -> bool {
    if is_list_or_heading(next) || prev.starts_with('#') || prev.starts_with('|') {
        return false;
    }
    if ends_with_terminal(prev) {
        // The sentence scanner decides (it keeps "...end.\nand more" together).
        return next.chars().next().is_some_and(|c| c.is_lowercase());
    }
    let starts_lower = next.chars().next().is_some_and(|c| c.is_lowercase() || c.is_ascii_digit());
    starts_lower || prev.chars().count() >= SHORT_LINE_CHARS
}

/// The whitespace-delimited word that ends right before byte `i` of `text` (within `from..i`).
fn word_before(text: &str, from: usize, i: usize) -> &str {
    let seg = &text[from..i];
    let start =
        seg.rfind(char::is_whitespace).map(|p| p + seg[p..].chars().next().map_or(1, char::len_utf8)).unwrap_or(0);
    seg[start..].trim_start_matches(['(', '[', '"', '\'', '“', '‘', '«'])
}

/// Whether the `.` at byte `dot` (after the sentence started at `seg_start`) ends an abbreviation,
/// an initial or a list number rather than the sentence. `next` is the next non-space char.
fn dot_is_not_boundary(text: &str, seg_start: usize, dot: usize, next: char) -> bool {
    let word = word_before(text, seg_start, dot);
    if word.is_empty() {
        return false;
    }
    let lower = word.to_lowercase();
    if ABBREVIATIONS.contains(&lower.as_str()) {
        return true;
    }
    if NUMBER_ABBREVIATIONS.contains(&lower.as_str()) && next.is_ascii_digit() {
        return true;
    }
    let mut chars = word.chars();
    // An initial: "J. K. Rowling" (a single capital letter).
    if let (Some(c), None) = (chars.next(), chars.next()) {
        if c.is_uppercase() {
            return true;
        }
    }
    // Dotted acronyms (U.S.A, e.g, a.m): keep together unless clearly a sentence end.
    if word.contains('.')
        && word.split('.').all(|p| !p.is_empty() && p.chars().count() <= 3 && p.chars().all(char::is_alphabetic))
    {
        return !matches!(lower.as_str(), "a.m" | "p.m");
    }
    // A list number or letter at the start of the sentence ("1. Introduction").
    let before = text[seg_start..dot].trim();
    if before == word && (word.chars().all(|c| c.is_ascii_digit()) && word.len() <= 3) {
        return true;
    }
    false
}

fn split_block(text: &str, (bs, be): (usize, usize), out: &mut Vec<Span>) {
    let block = &text[bs..be];
    let Some(first) = block.find(|c: char| !c.is_whitespace()) else { return };
    let mut seg_start = bs + first;
    let chars: Vec<(usize, char)> = block.char_indices().map(|(i, c)| (bs + i, c)).collect();
    let at = |k: usize| chars.get(k).map(|&(_, c)| c);
    let pos = |k: usize| chars.get(k).map_or(be, |&(i, _)| i);
    let mut k = 0;
    while k < chars.len() {
        let (i, c) = chars[k];
        if !TERMINATORS.contains(&c) || i < seg_start {
            k += 1;
            continue;
        }
        // Terminator run, then closing quotes/brackets.
        let mut j = k;
        while at(j).is_some_and(|c| TERMINATORS.contains(&c)) {
            j += 1;
        }
        let run: String = chars[k..j].iter().map(|&(_, c)| c).collect();
        while at(j).is_some_and(|c| CLOSERS.contains(&c)) {
            j += 1;
        }
        let end = pos(j);
        match at(j) {
            None => break, // end of block
            // Full-width terminators need no space after them.
            Some(c) if !c.is_whitespace() && run.contains(['。', '！', '？']) => {
                out.push(Span::new(seg_start, end));
                seg_start = end;
                k = j;
                continue;
            }
            Some(c) if !c.is_whitespace() => {
                k = j.max(k + 1);
                continue;
            }
            _ => {}
        }
        let mut n = j;
        while at(n).is_some_and(char::is_whitespace) {
            n += 1;
        }
        let Some(next) = at(n) else { break };
        // First letter of the next word, skipping opening quotes/brackets.
        let next_letter = chars[n..]
            .iter()
            .map(|&(_, c)| c)
            .find(|c| !matches!(c, '"' | '\'' | '“' | '‘' | '(' | '[' | '«' | '*' | '_'))
            .unwrap_or(next);
        let boundary = if next_letter.is_lowercase() {
            false
        } else if run == "." {
            !dot_is_not_boundary(text, seg_start, i, next_letter)
        } else if run.starts_with("..") || run.contains('…') {
            next_letter.is_uppercase()
        } else {
            true
        };
        if boundary {
            out.push(Span::new(seg_start, end));
            seg_start = pos(n);
        }
        k = n;
    }
    let rest = text[seg_start..be].trim_end();
    if !rest.is_empty() {
        out.push(Span::new(seg_start, seg_start + rest.len()));
    }
}

/// Cuts a span longer than [`MAX_SENTENCE_BYTES`] at whitespace (after `;`/`,` when possible).
fn cap_length(text: &str, span: Span, out: &mut Vec<Span>) {
    let mut start = span.start;
    while span.end - start > MAX_SENTENCE_BYTES {
        let mut limit = start + MAX_SENTENCE_BYTES;
        while !text.is_char_boundary(limit) {
            limit -= 1;
        }
        let seg = &text[start..limit];
        let cut = seg
            .rfind("; ")
            .or_else(|| seg.rfind(", "))
            .filter(|&p| p > MAX_SENTENCE_BYTES / 2)
            .map(|p| p + 1)
            .or_else(|| seg.rfind(char::is_whitespace))
            .filter(|&p| p > 0);
        let Some(cut) = cut else { break };
        let piece = text[start..start + cut].trim_end();
        if piece.is_empty() {
            break;
        }
        out.push(Span::new(start, start + piece.len()));
        let rest = &text[start + cut..span.end];
        start = start + cut + (rest.len() - rest.trim_start().len());
    }
    if start < span.end {
        out.push(Span::new(start, span.end));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_boxed_paragraph_reads_as_one_sentence() {
        let doc = "Section 6 follows.\n\n   ************************************************************\n   *                                                          *\n   *  6. Disclaimer of Warranty                               *\n   *  -------------------------                               *\n   *                                                          *\n   *  Covered Software is provided on an \"as is\" basis,      *\n   *  without warranty of any kind, either expressed or       *\n   *  implied.                                                *\n   *                                                          *\n   ************************************************************\n\nThe next section.";
        let clean = normalize_layout(doc);
        assert_eq!(clean.len(), doc.len(), "same bytes, same offsets");
        assert_eq!(clean.lines().count(), doc.lines().count());
        assert!(!clean.contains('*'), "{clean}");
        let sentences: Vec<String> = split_sentences(&clean).iter().map(|s| s.text(&clean).split_whitespace().collect::<Vec<_>>().join(" ")).collect();
        assert!(
            sentences.contains(&"Covered Software is provided on an \"as is\" basis, without warranty of any kind, either expressed or implied.".to_string()),
            "{sentences:#?}"
        );
        assert!(sentences.contains(&"6. Disclaimer of Warranty".to_string()), "the heading stands alone: {sentences:#?}");
        // The spans are the original's: its evidence keeps the borders it has.
        let span = split_sentences(&clean).into_iter().find(|s| s.text(&clean).contains("Covered")).unwrap();
        assert!(span.text(doc).starts_with("Covered Software") && span.text(doc).contains('*'));
        // Without the normalization the box's borders cut into the prose.
        let raw: Vec<&str> = split_sentences(doc).iter().map(|s| s.text(doc)).collect();
        assert!(!raw.iter().any(|s| s.starts_with("Covered") && s.ends_with("implied.")), "{raw:#?}");
    }

    #[test]
    fn layout_normalization_leaves_lists_tables_and_single_stars_alone() {
        let doc = "* a bullet item *emphasis*\n| a | table |\n|---|---|\n| 1 | 2 |\nA line with * in it.\n# Heading\n";
        let clean = normalize_layout(doc);
        assert!(clean.starts_with("* a bullet item *emphasis*\n| a | table |\n"), "{clean}");
        assert!(clean.contains("| 1 | 2 |") && clean.contains("A line with * in it.") && clean.contains("# Heading"), "{clean}");
        assert!(!clean.contains("|---|"), "a table's rule line is blank: {clean}");
        let underlined = "Title\n=====\nBody text here.";
        assert_eq!(normalize_layout(underlined), "Title\n     \nBody text here.");
    }

    fn sents(text: &str) -> Vec<&str> {
        let spans = split_sentences(text);
        check_invariants(text, &spans);
        spans.iter().map(|s| s.text(text)).collect()
    }

    /// Trimmed, non-empty, ordered, disjoint, on char boundaries, covering all non-whitespace.
    fn check_invariants(text: &str, spans: &[Span]) {
        let mut covered = 0usize;
        let mut last_end = 0;
        for s in spans {
            assert!(s.start < s.end, "empty span {s:?}");
            assert!(s.start >= last_end, "overlap/out of order at {s:?}");
            assert!(text.is_char_boundary(s.start) && text.is_char_boundary(s.end));
            let t = s.text(text);
            assert_eq!(t, t.trim(), "untrimmed span {t:?}");
            assert!(text[last_end..s.start].trim().is_empty(), "uncovered text {:?}", &text[last_end..s.start]);
            covered += t.chars().filter(|c| !c.is_whitespace()).count();
            last_end = s.end;
        }
        assert!(text[last_end..].trim().is_empty(), "uncovered tail {:?}", &text[last_end..]);
        assert_eq!(covered, text.chars().filter(|c| !c.is_whitespace()).count());
    }

    #[test]
    fn basic_punctuation() {
        assert_eq!(
            sents("Hello there. How are you? I am fine! Thanks."),
            ["Hello there.", "How are you?", "I am fine!", "Thanks."]
        );
        assert_eq!(sents("  Leading and trailing space.   "), ["Leading and trailing space."]);
        assert_eq!(sents("No final punctuation"), ["No final punctuation"]);
        assert!(sents("").is_empty());
        assert!(sents("   \n\n \t ").is_empty());
        assert_eq!(sents("Wait?! Really?? Yes."), ["Wait?!", "Really??", "Yes."]);
    }

    #[test]
    fn abbreviations_initials_and_decimals() {
        assert_eq!(
            sents("Mr. Smith met Dr. Jones at 3.14 p.m. on Monday. They talked."),
            ["Mr. Smith met Dr. Jones at 3.14 p.m. on Monday.", "They talked."]
        );
        assert_eq!(
            sents("The U.S. Army arrived. Prices rose 2.5 percent, e.g. for bread. J. K. Rowling wrote it."),
            ["The U.S. Army arrived.", "Prices rose 2.5 percent, e.g. for bread.", "J. K. Rowling wrote it."]
        );
        assert_eq!(
            sents("See Fig. 3 and No. 7 for details. Then stop."),
            ["See Fig. 3 and No. 7 for details.", "Then stop."]
        );
        assert_eq!(sents("The answer was no. Then we left."), ["The answer was no.", "Then we left."]);
        assert_eq!(sents("It costs approx. five dollars. Good."), ["It costs approx. five dollars.", "Good."]);
        assert_eq!(sents("Version 1.2.3 shipped. It works."), ["Version 1.2.3 shipped.", "It works."]);
        assert_eq!(sents("They met at 9 a.m. The talk began."), ["They met at 9 a.m.", "The talk began."]);
    }

    #[test]
    fn quotes_brackets_and_ellipses() {
        assert_eq!(
            sents("He said, \"Stop it.\" Then he left. (This was odd.) \"Why?\" she asked."),
            ["He said, \"Stop it.\"", "Then he left.", "(This was odd.)", "\"Why?\" she asked."]
        );
        assert_eq!(sents("She wrote “Done.” and smiled. Next."), ["She wrote “Done.” and smiled.", "Next."]);
        assert_eq!(sents("Well... maybe not. And then… Nothing."), ["Well... maybe not.", "And then…", "Nothing."]);
        assert_eq!(sents("He waited... Then he spoke."), ["He waited...", "Then he spoke."]);
    }

    #[test]
    fn newlines_headings_and_lists() {
        let text = "# The Report\n\nThe first paragraph starts here. It has two sentences.\n\nSecond paragraph\n\
                    - first item\n- second item with more words\n1. Numbered one\n2. Numbered two.\n\nEnd.";
        assert_eq!(
            sents(text),
            [
                "# The Report",
                "The first paragraph starts here.",
                "It has two sentences.",
                "Second paragraph",
                "- first item",
                "- second item with more words",
                "1. Numbered one",
                "2. Numbered two.",
                "End."
            ]
        );
        // Soft-wrapped prose lines are joined; a short unpunctuated line is its own sentence.
        let wrapped = "Chapter One\nThe committee met in the old town hall on a\nrainy evening and voted. After that the\nmembers went home.";
        assert_eq!(
            sents(wrapped),
            [
                "Chapter One",
                "The committee met in the old town hall on a\nrainy evening and voted.",
                "After that the\nmembers went home."
            ]
        );
        assert_eq!(sents("Line one\r\n\r\nLine two.\r\n"), ["Line one", "Line two."]);
    }

    #[test]
    fn lowercase_continuation_and_unicode() {
        assert_eq!(sents("\"Help!\" he cried. Ça va? Oui."), ["\"Help!\" he cried.", "Ça va?", "Oui."]);
        assert_eq!(sents("Zoë lives in Zürich. Ünal too."), ["Zoë lives in Zürich.", "Ünal too."]);
        assert_eq!(sents("日本語の文。次の文。"), ["日本語の文。", "次の文。"]);
        assert_eq!(sents("日本語の文。 次の文。"), ["日本語の文。", "次の文。"]);
    }

    #[test]
    fn long_runs_are_capped() {
        let text = "word ".repeat(700);
        let spans = split_sentences(&text);
        check_invariants(&text, &spans);
        assert!(spans.len() >= 3);
        assert!(spans.iter().all(|s| s.len() <= MAX_SENTENCE_BYTES));
    }

    #[test]
    fn invariants_on_messy_text() {
        let texts = [
            "a.b.c. d!!! ?? ... … \"\" () .. . ! x",
            "...\n\n...Start. ",
            "1.\n2.\n- \n-\n#\n",
            "Mr.\nDr.\n\nU.S.",
            "“Quoted.” ‘Single.’ «Guillemets.» (Paren.) [Bracket.]",
            "Ends with abbreviation Mr.",
        ];
        for t in texts {
            let spans = split_sentences(t);
            check_invariants(t, &spans);
        }
    }

    #[test]
    fn paragraphs() {
        let text = "\n  First para line one.\nline two.\n\n \t\nSecond para.\n\n\nThird.  ";
        let ps: Vec<&str> = split_paragraphs(text).iter().map(|s| s.text(text)).collect();
        assert_eq!(ps, ["First para line one.\nline two.", "Second para.", "Third."]);
        assert!(split_paragraphs("  \n\n ").is_empty());
    }

    #[test]
    fn list_markers() {
        assert_eq!(list_marker_len("- item"), 2);
        assert_eq!(list_marker_len("12. item"), 4);
        assert_eq!(list_marker_len("(a) item"), 4);
        assert_eq!(list_marker_len("b) item"), 3);
        assert_eq!(list_marker_len("3.14 is pi"), 0);
        assert_eq!(list_marker_len("-5 degrees"), 0);
        assert_eq!(list_marker_len("Alpha. Beta"), 0);
        assert_eq!(list_marker_len("a.m. is early"), 0);
    }
}
