//! Documents in the formats people have: plain text, Markdown, HTML and PDF, turned into the
//! plain text that is absorbed and stored. One entry point, [`extract`], used by `POST
//! /documents` (raw bodies and multipart uploads) and by `lift-serve absorb`; the [`Source`] it
//! returns says how the text was made and is kept with the document.

use serde::{Deserialize, Serialize};

/// A document format we read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Text,
    Markdown,
    Html,
    Pdf,
}

impl Format {
    /// The format a file name's extension names, if any.
    fn from_extension(filename: &str) -> Option<Self> {
        let ext = filename.rsplit_once('.')?.1.to_ascii_lowercase();
        Some(match ext.as_str() {
            "txt" | "text" | "log" | "csv" | "tsv" | "rst" | "org" | "adoc" | "tex" => Format::Text,
            "md" | "markdown" | "mdown" | "mkd" => Format::Markdown,
            "html" | "htm" | "xhtml" => Format::Html,
            "pdf" => Format::Pdf,
            _ => return None,
        })
    }

    /// The format a declared media type names: `Some(None)` for "unknown, look at the bytes"
    /// (`application/octet-stream`), `None` for a type we do not read.
    fn from_media_type(media_type: &str) -> Option<Option<Self>> {
        Some(Some(match media_type {
            "text/plain" => Format::Text,
            "text/markdown" | "text/x-markdown" => Format::Markdown,
            "text/html" | "application/xhtml+xml" => Format::Html,
            "application/pdf" | "application/x-pdf" => Format::Pdf,
            "application/octet-stream" | "binary/octet-stream" => return Some(None),
            _ => return None,
        }))
    }

    /// The format the bytes themselves show: a PDF header, an HTML start, or else UTF-8 text.
    fn sniff(bytes: &[u8]) -> Option<Self> {
        let head = &bytes[..bytes.len().min(1024)];
        let start = head.iter().position(|b| !b.is_ascii_whitespace()).map_or(&head[..0], |i| &head[i..]);
        if start.starts_with(b"%PDF-") {
            return Some(Format::Pdf);
        }
        let lower = String::from_utf8_lossy(&start[..start.len().min(64)]).to_ascii_lowercase();
        let lower = lower.trim_start_matches('\u{feff}');
        if lower.starts_with("<!doctype html") || lower.starts_with("<html") {
            return Some(Format::Html);
        }
        // Text: valid UTF-8 (a cut multi-byte character at the end of the sample is fine) and no NULs.
        let valid = match std::str::from_utf8(head) {
            Ok(_) => true,
            Err(e) => e.error_len().is_none(),
        };
        (valid && !head.contains(&0)).then_some(Format::Text)
    }
}

/// How a document's text was made: what was uploaded and what read it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Source {
    pub format: Format,
    /// The uploaded file's name, when it came as a file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filename: Option<String>,
    /// The media type the client declared, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// Size of what was uploaded.
    pub bytes: usize,
    /// Pages (PDF).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages: Option<usize>,
    /// Characters of the extracted text.
    pub characters: usize,
    /// What turned the upload into text.
    pub extraction: String,
}

impl Source {
    /// Text sent as it is (a JSON field or a `text/plain` body): kept exactly, not tidied.
    pub fn as_sent(text: &str, media_type: &str) -> Self {
        Self {
            format: Format::Text,
            filename: None,
            media_type: Some(media_type.to_string()),
            bytes: text.len(),
            pages: None,
            characters: text.chars().count(),
            extraction: AS_SENT.into(),
        }
    }
}

const AS_SENT: &str = "UTF-8 text as sent";

/// The text to absorb, a title found in the file (HTML `<title>`, PDF metadata), and its source.
#[derive(Debug)]
pub struct Extracted {
    pub text: String,
    pub title: Option<String>,
    pub source: Source,
}

/// Why a file gives no document. Each is the client's fault (4xx); the message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    #[error("{what} is not a format lift-serve reads; send plain text, Markdown, HTML or PDF")]
    Unsupported { what: String },
    #[error("{what} is not valid UTF-8 text ({detail}); save it as UTF-8 and upload it again")]
    NotUtf8 { what: String, detail: String },
    #[error("{what} is encrypted with a password; remove the password and upload it again")]
    EncryptedPdf { what: String },
    #[error("{what} could not be read as a PDF: {detail}")]
    UnreadablePdf { what: String, detail: String },
    #[error("no text could be extracted from {what}{pages}: {hint}")]
    NoText { what: String, pages: String, hint: &'static str },
}

impl ExtractError {
    /// The API's error code.
    pub fn code(&self) -> &'static str {
        match self {
            ExtractError::Unsupported { .. } => "unsupported_format",
            ExtractError::NotUtf8 { .. } => "invalid_utf8",
            ExtractError::EncryptedPdf { .. } => "encrypted_pdf",
            ExtractError::UnreadablePdf { .. } => "unreadable_pdf",
            ExtractError::NoText { .. } => "no_text",
        }
    }
}

/// Extracts the text of an upload. The format comes from the declared media type when it names
/// one, else from the file name's extension, else from the bytes (a declared PDF that is not one
/// is refused as unreadable rather than read as something else).
pub fn extract(bytes: &[u8], filename: Option<&str>, media_type: Option<&str>) -> Result<Extracted, ExtractError> {
    let what = match filename {
        Some(f) => format!("'{f}'"),
        None => "the body".to_string(),
    };
    let declared = match media_type {
        Some(m) => match Format::from_media_type(m) {
            Some(f) => f,
            None => return Err(ExtractError::Unsupported { what: format!("{what} ({m})") }),
        },
        None => None,
    };
    let by_name = filename.and_then(Format::from_extension);
    let format = match declared.or(by_name).or_else(|| Format::sniff(bytes)) {
        Some(f) => f,
        None => {
            let kind = if filename.is_some_and(|f| f.contains('.')) { " (by its name and contents)" } else { "" };
            return Err(ExtractError::Unsupported { what: format!("{what}{kind}") });
        }
    };
    let (text, title, pages, extraction) = match format {
        Format::Text => (utf8(bytes, &what)?.to_string(), None, None, AS_SENT.to_string()),
        Format::Markdown => (markdown_to_text(utf8(bytes, &what)?), None, None, "Markdown rendered to plain text (pulldown-cmark)".into()),
        Format::Html => {
            let (text, title) = html_to_text(&String::from_utf8_lossy(bytes));
            (text, title, None, "HTML text, scripts and styles dropped (scraper)".into())
        }
        Format::Pdf => {
            let pdf = pdf_to_text(bytes, &what)?;
            (pdf.text, pdf.title, Some(pdf.pages), "PDF text layer (pdf-extract)".into())
        }
    };
    let text = tidy(&text);
    if text.is_empty() && format != Format::Text {
        let hint = match format {
            Format::Pdf => "it has no text layer (a scanned or image-only PDF needs OCR first)",
            _ => "it holds no text outside markup, scripts and styles",
        };
        let pages = pages.map_or(String::new(), |p| format!(" ({p} page{})", if p == 1 { "" } else { "s" }));
        return Err(ExtractError::NoText { what, pages, hint });
    }
    let source = Source {
        format,
        filename: filename.map(str::to_string),
        media_type: media_type.map(str::to_string),
        bytes: bytes.len(),
        pages,
        characters: text.chars().count(),
        extraction,
    };
    Ok(Extracted { text, title: title.filter(|t| !t.is_empty()), source })
}

/// A document file from disk (`lift-serve absorb`, `ask --document`): its name and bytes decide
/// the format.
pub fn read_file(path: &std::path::Path) -> anyhow::Result<Extracted> {
    let bytes = std::fs::read(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let name = path.file_name().map(|f| f.to_string_lossy().to_string());
    Ok(extract(&bytes, name.as_deref(), None)?)
}

fn utf8<'a>(bytes: &'a [u8], what: &str) -> Result<&'a str, ExtractError> {
    let s = std::str::from_utf8(bytes)
        .map_err(|e| ExtractError::NotUtf8 { what: what.to_string(), detail: e.to_string() })?;
    Ok(s.strip_prefix('\u{feff}').unwrap_or(s))
}

/// Trailing spaces off every line, runs of blank lines down to one, no blank start or end; and
/// no control characters but newlines and tabs (PDF text layers carry form feeds and NULs).
fn tidy(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut blank_run = 0;
    for line in text.lines() {
        let line: String = line.chars().filter(|c| !c.is_control() || *c == '\t').collect();
        let line = line.trim_end();
        if line.trim().is_empty() {
            blank_run += 1;
            continue;
        }
        if !out.is_empty() {
            out.push_str(if blank_run > 0 { "\n\n" } else { "\n" });
        }
        blank_run = 0;
        out.push_str(line);
    }
    out
}

// ---------- Markdown ----------

/// Markdown as a reader sees it: headings, paragraphs and list items on their own lines, code
/// kept, link targets, emphasis marks and raw HTML dropped (the words of links and images kept).
fn markdown_to_text(md: &str) -> String {
    use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};
    let mut out = String::with_capacity(md.len());
    let mut lists: Vec<Option<u64>> = Vec::new();
    let parser = Parser::new_ext(md, Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH);
    for event in parser {
        match event {
            Event::Start(Tag::Heading { .. } | Tag::Paragraph | Tag::CodeBlock(_) | Tag::BlockQuote(_) | Tag::Table(_)) => {
                block_break(&mut out)
            }
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
            Event::End(TagEnd::Heading(_) | TagEnd::Paragraph | TagEnd::CodeBlock | TagEnd::TableRow | TagEnd::TableHead) => {
                line_break(&mut out)
            }
            Event::End(TagEnd::TableCell) => out.push_str(" | "),
            Event::Text(t) | Event::Code(t) => out.push_str(&t),
            Event::SoftBreak => out.push(' '),
            Event::HardBreak | Event::Rule => line_break(&mut out),
            _ => {}
        }
    }
    out
}

fn line_break(out: &mut String) {
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
}

fn block_break(out: &mut String) {
    line_break(out);
    if !out.is_empty() && !out.ends_with("\n\n") {
        out.push('\n');
    }
}

// ---------- HTML ----------

/// Elements whose content is never text for a reader.
const HTML_SKIPPED: &[&str] =
    &["script", "style", "noscript", "template", "head", "svg", "canvas", "iframe", "object", "select", "button"];
/// Elements that start and end a block (their text goes on lines of its own).
const HTML_BLOCKS: &[&str] = &[
    "address", "article", "aside", "blockquote", "body", "dd", "details", "div", "dl", "dt", "fieldset", "figcaption",
    "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li", "main", "nav", "ol", "p",
    "pre", "section", "summary", "table", "tr", "ul", "caption",
];

/// The text of an HTML page as a reader sees it, and its `<title>`: scripts, styles and other
/// non-text elements dropped, blocks on lines of their own, list items marked, table cells
/// separated, whitespace collapsed outside `<pre>`.
fn html_to_text(html: &str) -> (String, Option<String>) {
    let doc = scraper::Html::parse_document(html);
    let title = scraper::Selector::parse("title")
        .ok()
        .and_then(|s| doc.select(&s).next().map(|t| collapse_spaces(&t.text().collect::<String>())));
    let mut out = String::with_capacity(html.len() / 2);
    walk_html(doc.tree.root(), &mut out, false);
    (out, title)
}

fn walk_html(node: ego_tree::NodeRef<'_, scraper::Node>, out: &mut String, pre: bool) {
    for child in node.children() {
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
                walk_html(child, out, pre || name == "pre");
                match name {
                    "td" | "th" => out.push_str(" | "),
                    _ if block => {
                        trim_line_end(out);
                        line_break(out);
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
}

fn trim_line_end(out: &mut String) {
    while out.ends_with(' ') || out.ends_with('\t') {
        out.pop();
    }
}

fn collapse_spaces(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

// ---------- PDF ----------

struct PdfText {
    text: String,
    title: Option<String>,
    pages: usize,
}

/// The PDF's text layer, page by page. A PDF that opens only with a password is refused (one with
/// an empty user password, "owner-locked", opens and is read). The extractor panics on some
/// malformed files: a panic is that file's error, never the server's.
fn pdf_to_text(bytes: &[u8], what: &str) -> Result<PdfText, ExtractError> {
    let unreadable = |detail: String| ExtractError::UnreadablePdf { what: what.to_string(), detail };
    if !bytes.trim_ascii_start().starts_with(b"%PDF-") {
        return Err(unreadable("it does not start with a PDF header".into()));
    }
    let caught = std::panic::catch_unwind(|| -> Result<PdfText, ExtractError> {
        // Opening decrypts with the empty user password when that is the password.
        let doc = lopdf::Document::load_mem(bytes).map_err(|e| unreadable(e.to_string()))?;
        if doc.is_encrypted() && doc.authenticate_password("").is_err() {
            return Err(ExtractError::EncryptedPdf { what: what.to_string() });
        }
        let pages: Vec<u32> = doc.get_pages().keys().copied().collect();
        let mut text = String::new();
        for &n in &pages {
            let mut page = String::new();
            let mut output = pdf_extract::PlainTextOutput::new(&mut page);
            pdf_extract::output_doc_page(&doc, &mut output, n)
                .map_err(|e| unreadable(format!("page {n}: {e}")))?;
            if !text.is_empty() {
                text.push_str("\n\n");
            }
            text.push_str(&page);
        }
        Ok(PdfText { text, title: pdf_title(&doc), pages: pages.len() })
    });
    caught.unwrap_or_else(|_| Err(unreadable("its structure is malformed (the text extractor gave up)".into())))
}

/// The document information dictionary's `Title`, when it is a readable string.
fn pdf_title(doc: &lopdf::Document) -> Option<String> {
    let info = doc.trailer.get(b"Info").ok()?;
    let info = match info {
        lopdf::Object::Reference(id) => doc.get_dictionary(*id).ok()?,
        lopdf::Object::Dictionary(d) => d,
        _ => return None,
    };
    let title = info.get(b"Title").ok()?;
    let s = lopdf::decode_text_string(title).ok()?;
    Some(collapse_spaces(&s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_told_by_type_then_name_then_bytes() {
        assert_eq!(extract(b"plain words", Some("a.md"), None).unwrap().source.format, Format::Markdown);
        assert_eq!(extract(b"plain words", Some("a.md"), Some("text/plain")).unwrap().source.format, Format::Text);
        assert_eq!(extract(b"<!DOCTYPE html><p>hi</p>", None, None).unwrap().source.format, Format::Html);
        assert_eq!(extract(b"words", Some("notes"), Some("application/octet-stream")).unwrap().source.format, Format::Text);
        let e = extract(b"\x89PNG\r\n\x1a\n\0\0", Some("a.png"), None).unwrap_err();
        assert_eq!(e.code(), "unsupported_format", "{e}");
        let e = extract(b"words", Some("a.docx"), Some("application/vnd.openxmlformats-officedocument.wordprocessingml.document"))
            .unwrap_err();
        assert_eq!(e.code(), "unsupported_format");
        let e = extract(b"not a pdf", Some("a.pdf"), None).unwrap_err();
        assert_eq!(e.code(), "unreadable_pdf");
        let e = extract(b"caf\xe9", Some("a.txt"), None).unwrap_err();
        assert_eq!(e.code(), "invalid_utf8");
    }

    #[test]
    fn html_keeps_the_words_and_drops_the_rest() {
        let html = "<html><head><title> The  Harbor </title><style>p { color: red }</style>\
            <script>var secret = 1;</script></head><body><h1>Velmora</h1><p>Built in <b>1843</b>\n by Ada.</p>\
            <ul><li>north pier</li><li>east pier</li></ul><table><tr><td>a</td><td>b</td></tr></table>\
            <noscript>enable js</noscript><pre>  x = 1\n  y = 2</pre></body></html>";
        let e = extract(html.as_bytes(), Some("h.html"), None).unwrap();
        assert_eq!(e.title.as_deref(), Some("The Harbor"));
        assert_eq!(e.text, "Velmora\n\nBuilt in 1843 by Ada.\n- north pier\n- east pier\n\na | b |\n\n  x = 1\n  y = 2");
        assert!(!e.text.contains("secret") && !e.text.contains("color") && !e.text.contains("enable js"));
        let e = extract(b"<html><script>x()</script></html>", Some("e.html"), None).unwrap_err();
        assert_eq!(e.code(), "no_text");
    }

    #[test]
    fn markdown_becomes_plain_text() {
        let md = "# Title\n\nSome *emphasis* and a [link](http://example.invalid/x).\nSame paragraph.\n\n\
            1. one\n2. two\n\n- a\n  - b\n\n```\ncode line\n```\n\n<div>raw</div>\n";
        let e = extract(md.as_bytes(), Some("r.md"), None).unwrap();
        assert_eq!(e.text, "Title\n\nSome emphasis and a link. Same paragraph.\n1. one\n2. two\n- a\n  - b\n\ncode line");
    }

    #[test]
    fn text_is_tidied_but_kept() {
        let e = extract("\u{feff}\n\nline one   \n\n\n\nline two\n".as_bytes(), Some("t.txt"), None).unwrap();
        assert_eq!(e.text, "line one\n\nline two");
        assert_eq!(e.source.characters, 18);
        assert_eq!(e.source.extraction, "UTF-8 text as sent");
    }
}

#[cfg(test)]
mod pdf_tests {
    use super::*;
    use crate::testing::{write_pdf, PdfPages};

    #[test]
    fn a_pdf_gives_its_text_pages_and_title() {
        let pdf = write_pdf(PdfPages::Text(&["The harbor of Velmora was built in 1843.\nIt has three piers.", "The lighthouse is blue."]), "Velmora", None).unwrap();
        let e = extract(&pdf, Some("velmora.pdf"), Some("application/pdf")).unwrap();
        assert_eq!(e.source.format, Format::Pdf);
        assert_eq!(e.source.pages, Some(2));
        assert_eq!(e.title.as_deref(), Some("Velmora"));
        let words: Vec<&str> = e.text.split_whitespace().collect();
        assert_eq!(words.join(" "), "The harbor of Velmora was built in 1843. It has three piers. The lighthouse is blue.", "{:?}", e.text);
    }

    #[test]
    fn locked_scanned_and_broken_pdfs_are_refused_with_their_reason() {
        let locked = write_pdf(PdfPages::Text(&["secret plans"]), "Locked", Some("user-secret")).unwrap();
        assert_eq!(extract(&locked, Some("locked.pdf"), None).unwrap_err().code(), "encrypted_pdf");
        // Owner-locked only (empty user password): opens and reads like any other.
        let owner = write_pdf(PdfPages::Text(&["open plans"]), "Open", Some("")).unwrap();
        let e = extract(&owner, Some("owner.pdf"), None).unwrap();
        assert_eq!(e.text.split_whitespace().collect::<Vec<_>>(), ["open", "plans"]);
        let scan = write_pdf(PdfPages::ImageOnly, "Scan", None).unwrap();
        let e = extract(&scan, Some("scan.pdf"), None).unwrap_err();
        assert_eq!(e.code(), "no_text");
        assert!(e.to_string().contains("1 page") && e.to_string().contains("OCR"), "{e}");
        let mut cut = write_pdf(PdfPages::Text(&["some text"]), "Cut", None).unwrap();
        cut.truncate(cut.len() / 3);
        assert_eq!(extract(&cut, Some("cut.pdf"), None).unwrap_err().code(), "unreadable_pdf");
    }
}
