//! HTML: its depth measured by a scan of the tags before parsing, then the text a reader sees.

use super::{block_break, collapse_spaces, line_break, trim_line_end};

/// Elements that never hold content.
const HTML_VOID: &[&str] = &[
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track", "wbr",
    "keygen", "basefont", "bgsound", "frame",
];
/// Elements a parser closes by itself when a sibling starts (`<p>a<p>b`, `<li>`, table parts).
const HTML_SELF_ENDING: &[&str] = &[
    "p", "li", "td", "th", "tr", "dt", "dd", "option", "optgroup", "thead", "tbody", "tfoot", "colgroup", "rb", "rt",
    "rp", "rtc", "html", "head", "body",
];
/// HTML elements that end the `<svg>` or `<math>` they appear in.
const HTML_BREAKOUT: &[&str] = &[
    "b", "big", "blockquote", "body", "br", "center", "code", "dd", "div", "dl", "dt", "em", "embed", "h1", "h2", "h3",
    "h4", "h5", "h6", "head", "hr", "i", "img", "li", "listing", "menu", "meta", "nobr", "ol", "p", "pre", "ruby", "s",
    "small", "span", "strong", "strike", "sub", "sup", "table", "tt", "u", "ul", "var",
];
/// Elements whose content is raw text up to their end tag.
const HTML_RAW_TEXT: &[&str] = &["script", "style", "textarea", "title", "xmp", "iframe", "noembed", "noframes"];

/// Refuses HTML nested deeper than `max` (`Err(depth reached)`), measured by a linear scan of
/// the tags before the parser sees them (an HTML parser's work grows with the depth of the open
/// elements at every tag). An end tag closes the innermost open element of its name and those
/// inside it; an end tag of no open element is ignored, as a parser ignores it.
pub(super) fn html_depth(html: &[u8], max: u64) -> Result<(), u64> {
    let find = |from: usize, needle: &[u8]| html[from.min(html.len())..].windows(needle.len()).position(|w| w.eq_ignore_ascii_case(needle)).map(|p| p + from);
    let mut open: Vec<String> = Vec::new();
    let mut foreign = 0usize; // inside <svg> or <math>: `<x/>` opens nothing there
    let mut i = 0;
    while let Some(lt) = html[i.min(html.len())..].iter().position(|&b| b == b'<').map(|p| p + i) {
        i = lt + 1;
        if html[i..].starts_with(b"!--") {
            // From the first dash: `<!-->` and `<!--->` are whole (empty) comments to a parser.
            i = find(i + 1, b"-->").map_or(html.len(), |p| p + 3);
            continue;
        }
        let closing = html.get(i) == Some(&b'/');
        let start = if closing { i + 1 } else { i };
        let len = html[start..].iter().take_while(|b| b.is_ascii_alphanumeric() || **b == b'-' || **b == b':').count();
        if len == 0 || !html[start].is_ascii_alphabetic() {
            continue;
        }
        let name = String::from_utf8_lossy(&html[start..start + len]).to_ascii_lowercase();
        let end = html[start + len..].iter().position(|&b| b == b'>').map_or(html.len(), |p| p + start + len);
        let self_closing = end > 0 && html.get(end - 1) == Some(&b'/');
        i = (end + 1).min(html.len());
        if closing {
            if let Some(pos) = open.iter().rposition(|n| *n == name) {
                for n in open.drain(pos..) {
                    if n == "svg" || n == "math" {
                        foreign = foreign.saturating_sub(1);
                    }
                }
            }
            continue;
        }
        if HTML_RAW_TEXT.contains(&name.as_str()) && !self_closing {
            let mut close = b"</".to_vec();
            close.extend_from_slice(name.as_bytes());
            i = find(i, &close).unwrap_or(html.len());
            continue;
        }
        if foreign > 0 && HTML_BREAKOUT.contains(&name.as_str()) {
            // An HTML element ends the `<svg>` / `<math>` it appears in: it and what follows are HTML.
            while let Some(n) = open.pop() {
                if n == "svg" || n == "math" {
                    foreign -= 1;
                    break;
                }
            }
        }
        if HTML_VOID.contains(&name.as_str()) || HTML_SELF_ENDING.contains(&name.as_str()) || (self_closing && foreign > 0) {
            continue;
        }
        if name == "svg" || name == "math" {
            foreign += 1;
        }
        open.push(name);
        if open.len() as u64 > max {
            return Err(open.len() as u64);
        }
    }
    Ok(())
}

/// Elements whose content is never text for a reader.
const HTML_SKIPPED: &[&str] =
    &["script", "style", "noscript", "template", "head", "svg", "canvas", "iframe", "object", "select", "button"];
/// Elements that start and end a block (their text goes on lines of its own).
const HTML_BLOCKS: &[&str] = &[
    "address", "article", "aside", "blockquote", "body", "dd", "details", "div", "dl", "dt", "fieldset", "figcaption",
    "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li", "main", "nav", "ol", "p",
    "pre", "section", "summary", "table", "tr", "ul", "caption",
];

/// The text of an HTML page as a reader sees it, and its title (`<title>`, else the first
/// heading): scripts, styles and other non-text elements dropped, blocks on lines of their own,
/// list items marked, table cells separated, whitespace collapsed outside `<pre>`.
pub(super) fn html_to_text(html: &str) -> (String, Option<String>) {
    let doc = scraper::Html::parse_document(html);
    // The page's <title>, else its first heading.
    let first = |selector: &str| {
        scraper::Selector::parse(selector)
            .ok()
            .and_then(|s| doc.select(&s).map(|t| collapse_spaces(&t.text().collect::<String>())).find(|t| !t.is_empty()))
    };
    let title = first("title").or_else(|| first("h1, h2, h3, h4, h5, h6"));
    let mut out = String::with_capacity(html.len() / 2);
    walk_html(doc.tree.root(), &mut out, false);
    (out, title)
}

/// The text under `root`, in document order. An explicit stack, not recursion: the depth is
/// the document's (bounded by [`html_depth`] before parsing, but never trusted with the stack).
fn walk_html(root: ego_tree::NodeRef<'_, scraper::Node>, out: &mut String, pre: bool) {
    enum Step<'a> {
        Node(ego_tree::NodeRef<'a, scraper::Node>, bool),
        End(&'a str, bool),
    }
    let mut stack: Vec<Step<'_>> = root.children().rev().map(|c| Step::Node(c, pre)).collect();
    while let Some(step) = stack.pop() {
        let (child, pre) = match step {
            Step::Node(child, pre) => (child, pre),
            Step::End(name, block) => {
                match name {
                    "td" | "th" => out.push_str(" | "),
                    _ if block => {
                        trim_line_end(out);
                        line_break(out);
                    }
                    _ => {}
                }
                continue;
            }
        };
        match child.value() {
            scraper::Node::Text(t) => {
                if pre {
                    out.push_str(t);
                } else {
                    let s = collapse_spaces(t);
                    if !s.is_empty() {
                        let starts_space = t.starts_with(char::is_whitespace);
                        if starts_space && !out.is_empty() && !out.ends_with([' ', '\n']) {
                            out.push(' ');
                        }
                        out.push_str(&s);
                        if t.ends_with(char::is_whitespace) {
                            out.push(' ');
                        }
                    }
                }
            }
            scraper::Node::Element(e) => {
                let name = e.name();
                if HTML_SKIPPED.contains(&name) {
                    continue;
                }
                let block = HTML_BLOCKS.contains(&name);
                if block {
                    trim_line_end(out);
                    line_break(out);
                    if matches!(name, "p" | "h1" | "h2" | "h3" | "h4" | "h5" | "h6" | "pre" | "blockquote" | "table") {
                        block_break(out);
                    }
                }
                match name {
                    "br" => {
                        trim_line_end(out);
                        out.push('\n');
                    }
                    "li" => out.push_str("- "),
                    "img" => {
                        if let Some(alt) = e.attr("alt").map(collapse_spaces).filter(|a| !a.is_empty()) {
                            out.push_str(&alt);
                        }
                    }
                    _ => {}
                }
                stack.push(Step::End(name, block));
                let inner = pre || name == "pre";
                stack.extend(child.children().rev().map(|c| Step::Node(c, inner)));
            }
            _ => {}
        }
    }
}
