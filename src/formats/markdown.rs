//! Markdown: its depth measured before parsing, then rendered to the text a reader sees.

use super::{block_break, line_break};

/// Refuses Markdown nested deeper than `max` (`Err(depth reached)`), counted line by line before
/// the parser sees it: the container marks a line opens with (`>`, `-`, `*`, `+`, `1.`, `1)`),
/// plus one level per two columns of indentation (how nested list items are written). Lines end
/// where CommonMark ends them: at `\n`, `\r\n` or a lone `\r` (the fuzzer found a list nested
/// 50,000 deep behind `a\r`, which `str::lines` reads as one line).
pub(super) fn markdown_depth(md: &str, max: u64) -> Result<(), u64> {
    for line in md.split(['\n', '\r']) {
        let bytes = line.as_bytes();
        let (mut i, mut depth, mut columns) = (0, 0u64, 0u64);
        loop {
            match bytes.get(i) {
                Some(b' ') => columns += 1,
                Some(b'\t') => columns += 4,
                Some(b'>') => depth += 1,
                Some(b'-' | b'*' | b'+') if matches!(bytes.get(i + 1), Some(b' ' | b'\t') | None) => depth += 1,
                Some(b'0'..=b'9') => {
                    let digits = bytes[i..].iter().take_while(|b| b.is_ascii_digit()).count();
                    match (bytes.get(i + digits), bytes.get(i + digits + 1)) {
                        (Some(b'.' | b')'), Some(b' ' | b'\t') | None) if digits <= 9 => {
                            depth += 1;
                            i += digits;
                        }
                        _ => break,
                    }
                }
                _ => break,
            }
            i += 1;
            if depth + columns / 2 > max {
                return Err(depth + columns / 2);
            }
        }
    }
    Ok(())
}

/// Markdown as a reader sees it: headings, paragraphs and list items on their own lines, code
/// kept, link targets, emphasis marks and raw HTML dropped (the words of links and images kept);
/// and its title, the text of its first heading. Stops with `Err(characters written)` once the
/// text passes `max_chars`, so no input makes more text than the budget (list indentation grows
/// with depth: the text can be larger than the Markdown).
pub(super) fn markdown_to_text(md: &str, max_chars: u64) -> Result<(String, Option<String>), u64> {
    use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};
    let mut out = String::with_capacity(md.len());
    let mut lists: Vec<Option<u64>> = Vec::new();
    // The first heading's text, while it is read (Some) and once it is (done).
    let (mut title, mut heading_from, mut done) = (None::<String>, None::<usize>, false);
    let parser = Parser::new_ext(md, Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH);
    for event in parser {
        // A character is at most four bytes: past four bytes a character, the text is over.
        if out.len() as u64 > max_chars.saturating_mul(4) {
            return Err(out.chars().count() as u64);
        }
        match event {
            Event::Start(Tag::Heading { .. }) => {
                block_break(&mut out);
                if !done {
                    heading_from = Some(out.len());
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some(from) = heading_from.take() {
                    title = Some(super::collapse_spaces(&out[from..])).filter(|t| !t.is_empty());
                    done = title.is_some();
                }
                line_break(&mut out)
            }
            Event::Start(Tag::Paragraph | Tag::CodeBlock(_) | Tag::BlockQuote(_) | Tag::Table(_)) => block_break(&mut out),
            Event::Start(Tag::List(start)) => {
                lists.push(start);
                line_break(&mut out);
            }
            Event::End(TagEnd::List(_)) => {
                lists.pop();
            }
            Event::Start(Tag::Item) => {
                line_break(&mut out);
                out.push_str(&"  ".repeat(lists.len().saturating_sub(1)));
                match lists.last_mut() {
                    Some(Some(n)) => {
                        out.push_str(&format!("{n}. "));
                        *n += 1;
                    }
                    _ => out.push_str("- "),
                }
            }
            Event::End(TagEnd::Paragraph | TagEnd::CodeBlock | TagEnd::TableRow | TagEnd::TableHead) => {
                line_break(&mut out)
            }
            Event::End(TagEnd::TableCell) => out.push_str(" | "),
            Event::Text(t) | Event::Code(t) => out.push_str(&t),
            Event::SoftBreak => out.push(' '),
            Event::HardBreak | Event::Rule => line_break(&mut out),
            _ => {}
        }
    }
    Ok((out, title))
}
