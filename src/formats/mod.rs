//! Documents in the formats people have: plain text, Markdown, HTML, PDF, Word (`.docx`),
//! OpenDocument text (`.odt`) and EPUB, turned into the
//! plain text that is absorbed and stored. One entry point, [`extract`], used by `POST
//! /documents` (raw bodies and multipart uploads) and by `lift-serve absorb`; the [`Source`] it
//! returns says how the text was made and is kept with the document.

mod html;
mod markdown;
mod pdf;
mod zipped;

use html::{html_depth, html_to_text};
use markdown::{markdown_depth, markdown_to_text};
use pdf::pdf_to_text;
use zipped::{docx_to_text, epub_to_text, odt_to_text};
use serde::{Deserialize, Serialize};

/// A document format we read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Text,
    Markdown,
    Html,
    Pdf,
    Docx,
    Odt,
    Epub,
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
            "docx" => Format::Docx,
            "odt" => Format::Odt,
            "epub" => Format::Epub,
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
            "application/vnd.openxmlformats-officedocument.wordprocessingml.document" => Format::Docx,
            "application/vnd.oasis.opendocument.text" => Format::Odt,
            "application/epub+zip" => Format::Epub,
            "application/octet-stream" | "binary/octet-stream" | "application/zip" | "application/x-zip-compressed" => {
                return Some(None)
            }
            _ => return None,
        }))
    }

    /// The format the bytes themselves show: a PDF header, a ZIP package of a format we read (its
    /// `mimetype` member, or a Word body among its names), an HTML start, or else UTF-8 text.
    fn sniff(bytes: &[u8]) -> Option<Self> {
        if bytes.starts_with(b"PK\x03\x04") {
            let head = &bytes[..bytes.len().min(256)];
            let has = |s: &[u8], needle: &[u8]| s.windows(needle.len()).any(|w| w == needle);
            return if head.get(30..38) == Some(b"mimetype") && has(head, b"application/epub+zip") {
                Some(Format::Epub)
            } else if head.get(30..38) == Some(b"mimetype") && has(head, b"application/vnd.oasis.opendocument.text") {
                Some(Format::Odt)
            } else if has(bytes, b"word/document.xml") {
                Some(Format::Docx)
            } else {
                None
            };
        }
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
    #[error("{what} is not a format lift-serve reads; send plain text, Markdown, HTML, PDF, Word (.docx), OpenDocument text (.odt) or EPUB")]
    Unsupported { what: String },
    #[error("{what} is not valid UTF-8 text ({detail}); save it as UTF-8 and upload it again")]
    NotUtf8 { what: String, detail: String },
    #[error("{what} is encrypted with a password; remove the password and upload it again")]
    EncryptedPdf { what: String },
    #[error("{what} could not be read as a PDF: {detail}")]
    UnreadablePdf { what: String, detail: String },
    #[error("{what} is encrypted or protected; remove the protection and upload it again")]
    EncryptedDocument { what: String },
    #[error("{what} could not be read as {kind}: {detail}")]
    UnreadableDocument { what: String, kind: &'static str, detail: String },
    #[error("no text could be extracted from {what}{pages}: {hint}")]
    NoText { what: String, pages: String, hint: &'static str },
    /// A size budget: the upload's bytes or the extracted text's characters.
    #[error("{what} is too large: its {limit} reached {value}; the limit is {max}")]
    TooLarge { what: String, limit: &'static str, value: u64, max: u64 },
    /// A structure budget: nesting depth, objects, pages.
    #[error("{what} is too complex to read: its {limit} reached {value}; the limit is {max}")]
    TooComplex { what: String, limit: &'static str, value: u64, max: u64 },
    /// A compressed stream (or all of them together) inflates past its budget.
    #[error("{what} inflates past the decompression limit: {limit} passed {max} bytes (stopped at {value})")]
    Decompression { what: String, limit: &'static str, value: u64, max: u64 },
}

impl ExtractError {
    /// The API's error code.
    pub fn code(&self) -> &'static str {
        match self {
            ExtractError::Unsupported { .. } => "unsupported_format",
            ExtractError::NotUtf8 { .. } => "invalid_utf8",
            ExtractError::EncryptedPdf { .. } => "encrypted_pdf",
            ExtractError::UnreadablePdf { .. } => "unreadable_pdf",
            ExtractError::EncryptedDocument { .. } => "encrypted_document",
            ExtractError::UnreadableDocument { .. } => "unreadable_document",
            ExtractError::NoText { .. } => "no_text",
            ExtractError::TooLarge { .. } => "document_too_large",
            ExtractError::TooComplex { .. } => "document_too_complex",
            ExtractError::Decompression { .. } => "decompression_limit",
        }
    }

    /// The HTTP status of the refusal.
    pub fn status(&self) -> u16 {
        match self {
            ExtractError::Unsupported { .. } => 415,
            ExtractError::NotUtf8 { .. } => 400,
            ExtractError::TooLarge { .. } | ExtractError::Decompression { .. } => 413,
            _ => 422,
        }
    }
}

/// Budgets every extraction runs under, enforced where the work happens: the input is measured
/// before parsing, nesting is measured by a cheap scan before a parser sees the bytes, every
/// encoded PDF stream is decoded through a bounded reader before the text extractor touches it
/// (which then finds it plain), and the output is counted as it grows. (Wall time and memory are the extraction worker's:
/// `crate::extraction`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Limits {
    /// Bytes of the upload.
    pub max_input_bytes: u64,
    /// Nesting depth: HTML elements, Markdown containers (lists, quotes), PDF arrays and
    /// dictionaries.
    pub max_depth: u64,
    /// Bytes one compressed PDF stream may inflate to.
    pub max_stream_bytes: u64,
    /// Bytes all compressed PDF streams together may inflate to.
    pub max_inflated_bytes: u64,
    /// PDF objects.
    pub max_objects: u64,
    /// PDF pages.
    pub max_pages: u64,
    /// Characters of extracted text.
    pub max_output_chars: u64,
    /// Entries of a ZIP package (`.docx`, `.odt`, `.epub`), read from its end record before the
    /// archive is opened. Its members inflate under `max_stream_bytes` each and
    /// `max_inflated_bytes` in all.
    pub max_archive_entries: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_input_bytes: 64 << 20,
            max_depth: 256,
            max_stream_bytes: 8 << 20,
            max_inflated_bytes: 32 << 20,
            max_objects: 200_000,
            max_pages: 5_000,
            max_output_chars: 8_000_000,
            max_archive_entries: 10_000,
        }
    }
}

/// Extracts the text of an upload. The format comes from the declared media type when it names
/// one, else from the file name's extension, else from the bytes (a declared PDF that is not one
/// is refused as unreadable rather than read as something else).
pub fn extract(bytes: &[u8], filename: Option<&str>, media_type: Option<&str>) -> Result<Extracted, ExtractError> {
    extract_with(bytes, filename, media_type, &Limits::default())
}

/// The format an upload is read as, decided as [`extract`] decides it (None: none we read).
pub fn format_of(bytes: &[u8], filename: Option<&str>, media_type: Option<&str>) -> Option<Format> {
    let declared = match media_type {
        Some(m) => Format::from_media_type(m)?,
        None => None,
    };
    declared.or_else(|| filename.and_then(Format::from_extension)).or_else(|| Format::sniff(bytes))
}

/// [`extract`] under the given budgets.
pub fn extract_with(
    bytes: &[u8],
    filename: Option<&str>,
    media_type: Option<&str>,
    limits: &Limits,
) -> Result<Extracted, ExtractError> {
    let what = match filename {
        Some(f) => format!("'{f}'"),
        None => "the body".to_string(),
    };
    if let Some(m) = media_type.filter(|m| Format::from_media_type(m).is_none()) {
        return Err(ExtractError::Unsupported { what: format!("{what} ({m})") });
    }
    let format = match format_of(bytes, filename, media_type) {
        Some(f) => f,
        None => {
            let kind = if filename.is_some_and(|f| f.contains('.')) { " (by its name and contents)" } else { "" };
            return Err(ExtractError::Unsupported { what: format!("{what}{kind}") });
        }
    };
    let over = |limit, value: u64, max: u64| (value > max).then(|| ExtractError::TooLarge { what: what.clone(), limit, value, max });
    if let Some(e) = over("size in bytes", bytes.len() as u64, limits.max_input_bytes) {
        return Err(e);
    }
    let too_deep = |depth: u64| ExtractError::TooComplex { what: what.clone(), limit: "nesting depth", value: depth, max: limits.max_depth };
    let (text, title, pages, extraction) = match format {
        Format::Text => (utf8(bytes, &what)?.to_string(), None, None, AS_SENT.to_string()),
        Format::Markdown => {
            let md = utf8(bytes, &what)?;
            markdown_depth(md, limits.max_depth).map_err(too_deep)?;
            let (text, title) = markdown_to_text(md, limits.max_output_chars)
                .map_err(|chars| ExtractError::TooLarge { what: what.clone(), limit: "extracted text in characters", value: chars, max: limits.max_output_chars })?;
            (text, title, None, "Markdown rendered to plain text (pulldown-cmark)".into())
        }
        Format::Html => {
            html_depth(bytes, limits.max_depth).map_err(too_deep)?;
            let (text, title) = html_to_text(&String::from_utf8_lossy(bytes));
            (text, title, None, "HTML text, scripts and styles dropped (scraper)".into())
        }
        Format::Pdf => {
            let pdf = pdf_to_text(bytes, &what, limits)?;
            (pdf.text, pdf.title, Some(pdf.pages), "PDF text layer (pdf-extract)".into())
        }
        Format::Docx => {
            let doc = docx_to_text(bytes, &what, limits)?;
            (doc.text, doc.title, None, "Word body text, paragraph by paragraph (zip, quick-xml)".into())
        }
        Format::Odt => {
            let doc = odt_to_text(bytes, &what, limits)?;
            (doc.text, doc.title, None, "OpenDocument body text, paragraph by paragraph (zip, quick-xml)".into())
        }
        Format::Epub => {
            let doc = epub_to_text(bytes, &what, limits)?;
            (doc.text, doc.title, None, "EPUB chapters in reading order, read as HTML (zip, quick-xml, scraper)".into())
        }
    };
    let text = tidy(&text);
    if let Some(e) = over("extracted text in characters", text.chars().count() as u64, limits.max_output_chars) {
        return Err(e);
    }
    if text.is_empty() && format != Format::Text {
        let hint = match format {
            Format::Pdf => "it has no text layer (a scanned or image-only PDF needs OCR first)",
            Format::Docx | Format::Odt | Format::Epub => "it holds no text, only markup, pictures or empty paragraphs",
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
    Ok(extract_with(&bytes, name.as_deref(), None, &Limits::default())?)
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

pub(super) fn line_break(out: &mut String) {
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
}

pub(super) fn block_break(out: &mut String) {
    line_break(out);
    if !out.is_empty() && !out.ends_with("\n\n") {
        out.push('\n');
    }
}

pub(super) fn trim_line_end(out: &mut String) {
    while out.ends_with(' ') || out.ends_with('\t') {
        out.pop();
    }
}

pub(super) fn collapse_spaces(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
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
        assert_eq!(e.code(), "unreadable_document", "{e}");
        let e = extract(b"words", Some("a.xlsx"), Some("application/vnd.ms-excel")).unwrap_err();
        assert_eq!(e.code(), "unsupported_format", "{e}");
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
    fn markdown_and_html_titles_come_from_the_first_heading() {
        let title = |bytes: &[u8], name| extract(bytes, Some(name), None).unwrap().title;
        assert_eq!(title(b"# The *Harbor* of Velmora\n\ntext\n\n# Later\n", "a.md").as_deref(), Some("The Harbor of Velmora"));
        assert_eq!(title(b"Opening words.\n\nSetext heading\n---\n\n# Later\n", "b.md").as_deref(), Some("Setext heading"));
        assert_eq!(title(b"no heading at all\n", "c.md"), None);
        assert_eq!(title(b"#\n\n## Second\n", "d.md").as_deref(), Some("Second"), "an empty heading is no title");
        assert_eq!(title(b"<p>intro</p><h2>Chapter <b>One</b></h2><h1>Later</h1>", "e.html").as_deref(), Some("Chapter One"));
        assert_eq!(title(b"<title>Page</title><h1>Heading</h1>", "f.html").as_deref(), Some("Page"));
        assert_eq!(title(b"<title> </title><h1>Heading</h1>", "g.html").as_deref(), Some("Heading"));
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
    fn every_text_showing_operator_is_read() {
        // Standard Helvetica, an uncompressed content stream: `'` moves to the next line and shows
        // a string, `"` sets word and character spacing first; `\256` is the fi ligature.
        let content = "BT /F1 12 Tf 14 TL 72 720 Td (First line by Tj.) Tj (Second line by quote.) ' \
            1 0 (Third line by double quote.) \" T* [(Fourth) -300 (line by TJ, \\256ve.)] TJ T* (Last.) Tj ET";
        let pdf = write_pdf(PdfPages::Content(&[content]), "Quotes", None).unwrap();
        assert!(!pdf.windows(11).any(|w| w == b"FlateDecode"), "the stream is uncompressed");
        let e = extract(&pdf, Some("quotes.pdf"), None).unwrap();
        let lines: Vec<String> = e.text.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect();
        assert_eq!(
            lines,
            ["First line by Tj.", "Second line by quote.", "Third line by double quote.", "Fourth line by TJ, five.", "Last."],
            "{:?}",
            e.text
        );
    }

    #[test]
    fn a_cid_font_with_a_to_unicode_map_and_width_ranges_is_read() {
        // Each string placed where the previous one ends (two glyphs of 500 units at 12 pt: 12 pt
        // on); a space is a gap. Read with the default width (0), "ab" would end at once and
        // every placed string would start a new word.
        let content = "BT /F1 12 Tf 72 720 Td <00010002> Tj 12 0 Td <0003> Tj 6 0 Td <0004> Tj \
            18 0 Td <0005000600070008> Tj 0 -14 Td <001A0019> Tj ET";
        let pdf = write_pdf(PdfPages::CidContent(&[content]), "CID", None).unwrap();
        let e = extract(&pdf, Some("cid.pdf"), None).unwrap();
        assert_eq!(e.text, "abcd efgh\nzy", "{:?}", e.text);
    }

    /// Object streams are measured as the parser reads them; the objects inside them (here the
    /// pages, fonts and title) must come through that unchanged.
    #[test]
    fn a_pdf_with_object_streams_is_read() {
        let pdf = crate::testing::write_pdf_with_object_streams(PdfPages::Text(&["The harbor of Velmora was built in 1843.", "The lighthouse is blue."]), "Packed").unwrap();
        assert!(pdf.windows(7).any(|w| w == b"/ObjStm"), "the objects are packed");
        let e = extract(&pdf, Some("packed.pdf"), None).unwrap();
        assert!(e.text.contains("built in 1843") && e.text.contains("lighthouse is blue"), "{}", e.text);
        assert_eq!((e.title.as_deref(), e.source.pages), (Some("Packed"), Some(2)));
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

#[cfg(test)]
mod zipped_tests {
    use super::*;
    use crate::testing::packages::{docx, docx_paragraph, epub, odt, zip};

    #[test]
    fn a_docx_gives_its_paragraphs_in_order_and_headings_as_lines() {
        let body = [
            docx_paragraph("The Harbor of Velmora", Some("Title")),
            docx_paragraph("History", Some("Heading1")),
            r#"<w:p><w:pPr><w:tabs><w:tab w:val="left" w:pos="720"/></w:tabs></w:pPr><w:r><w:t xml:space="preserve">Built in 1843 </w:t></w:r><w:r><w:rPr><w:b/></w:rPr><w:t>by Ada</w:t></w:r><w:r><w:tab/><w:t>&amp; friends&#8230;</w:t></w:r></w:p>"#.into(),
            r#"<w:p><w:r><w:delText>deleted words</w:delText><w:instrText>PAGEREF x</w:instrText><w:t>Kept.</w:t><w:br/><w:t>Next line.</w:t></w:r></w:p>"#.into(),
            r#"<w:p><w:pPr><w:numPr><w:ilvl w:val="0"/></w:numPr></w:pPr><w:r><w:t>north pier</w:t></w:r></w:p>"#.into(),
            r#"<w:p><w:pPr><w:numPr/></w:pPr><w:r><w:t>east pier</w:t></w:r></w:p><w:p/>"#.into(),
            r#"<w:tbl><w:tr><w:tc><w:p><w:r><w:t>cell a</w:t></w:r></w:p></w:tc><w:tc><w:p><w:r><w:t>cell b</w:t></w:r></w:p></w:tc></w:tr></w:tbl>"#.into(),
            // A text box: its drawing, then the same box again as a fallback.
            r#"<w:p><w:r><mc:AlternateContent><mc:Choice Requires="wps"><w:drawing><w:txbxContent><w:p><w:r><w:t>boxed</w:t><w:noBreakHyphen/><w:t>words</w:t></w:r></w:p></w:txbxContent></w:drawing></mc:Choice><mc:Fallback><w:pict><w:txbxContent><w:p><w:r><w:t>boxed again</w:t></w:r></w:p></w:txbxContent></w:pict></mc:Fallback></mc:AlternateContent></w:r></w:p>"#.into(),
        ]
        .concat();
        let file = docx(&body, None);
        let e = extract(&file, Some("harbor.docx"), None).unwrap();
        assert_eq!(e.source.format, Format::Docx);
        assert_eq!(e.title.as_deref(), Some("The Harbor of Velmora"), "the first heading, when the file has no title");
        assert_eq!(
            e.text,
            "The Harbor of Velmora\n\nHistory\n\nBuilt in 1843 by Ada\t& friends\u{2026}\n\nKept.\nNext line.\nnorth pier\neast pier\ncell a\ncell b\n\nboxed-words"
        );
        // Told by its bytes too; the package's own title comes first.
        let e = extract(&docx(&body, Some("Velmora &amp; Co")), None, Some("application/octet-stream")).unwrap();
        assert_eq!((e.source.format, e.title.as_deref()), (Format::Docx, Some("Velmora & Co")));
        let e = extract(&docx("<w:p/><w:p><w:r><w:t> </w:t></w:r></w:p>", None), Some("empty.docx"), None).unwrap_err();
        assert_eq!(e.code(), "no_text", "{e}");
    }

    #[test]
    fn an_odt_gives_its_headings_and_paragraphs_with_odf_spacing() {
        let body = r#"<text:sequence-decls><text:sequence-decl text:name="Figure"/></text:sequence-decls><text:h text:outline-level="1">Kestrel Observatory</text:h><text:p>Founded   in <text:span>1902</text:span>,<text:s text:c="2"/>on the ridge.<text:note><text:note-citation>1</text:note-citation><text:note-body><text:p>A footnote.</text:p></text:note-body></text:note></text:p><text:list><text:list-item><text:p>dome</text:p></text:list-item><text:list-item><text:p>telescope</text:p></text:list-item></text:list><text:p>Line one<text:line-break/>line two<text:tab/>tabbed &amp; done.</text:p><text:h text:outline-level="2">Instruments</text:h>"#;
        let e = extract(&odt(body, None), Some("kestrel.odt"), None).unwrap();
        assert_eq!(e.source.format, Format::Odt);
        assert_eq!(e.title.as_deref(), Some("Kestrel Observatory"));
        assert_eq!(
            e.text,
            "Kestrel Observatory\n\nFounded in 1902,  on the ridge.\ndome\ntelescope\n\nLine one\nline two\ttabbed & done.\n\nInstruments"
        );
        let e = extract(&odt(body, Some("The Observatory")), None, None).unwrap();
        assert_eq!((e.source.format, e.title.as_deref()), (Format::Odt, Some("The Observatory")));
    }

    #[test]
    fn an_epub_gives_its_chapters_in_spine_order() {
        let file = epub(
            "The Voyage",
            &[("chapter 1.xhtml", "<h1>Arrival</h1><p>The ship came in.</p>"), ("ch2.xhtml", "<h2>Departure</h2><p>It left &amp; sailed.</p>")],
        );
        let e = extract(&file, Some("voyage.epub"), None).unwrap();
        assert_eq!(e.source.format, Format::Epub);
        assert_eq!(e.title.as_deref(), Some("The Voyage"));
        assert_eq!(e.text, "Arrival\n\nThe ship came in.\n\nDeparture\n\nIt left & sailed.");
        assert_eq!(extract(&file, None, None).unwrap().source.format, Format::Epub);
    }

    #[test]
    fn broken_and_protected_packages_are_refused_with_their_reason() {
        let e = extract(b"PK\x03\x04 not really a zip", Some("x.docx"), None).unwrap_err();
        assert_eq!((e.code(), e.status()), ("unreadable_document", 422), "{e}");
        assert!(e.to_string().contains("Word (.docx)"), "{e}");
        let e = extract(&zip(&[("mimetype", b"application/vnd.oasis.opendocument.text")]), Some("x.odt"), None).unwrap_err();
        assert!(e.code() == "unreadable_document" && e.to_string().contains("content.xml"), "{e}");
        let e = extract(&odt("<text:p>unclosed", None), Some("x.odt"), None).unwrap_err();
        assert_eq!(e.code(), "unreadable_document", "{e}");
        let e = extract(&zip(&[("mimetype", b"application/epub+zip")]), Some("x.epub"), None).unwrap_err();
        assert_eq!(e.code(), "unreadable_document", "{e}");
        // An encrypted Word file is an OLE compound file with an EncryptionInfo stream.
        let mut ole = b"\xD0\xCF\x11\xE0\xA1\xB1\x1A\xE1".to_vec();
        ole.extend_from_slice(&[0; 512]);
        ole.extend("EncryptionInfo".encode_utf16().flat_map(u16::to_le_bytes));
        let e = extract(&ole, Some("locked.docx"), None).unwrap_err();
        assert_eq!((e.code(), e.status()), ("encrypted_document", 422), "{e}");
        let e = extract(&ole[..520], Some("old.docx"), None).unwrap_err();
        assert!(e.code() == "unreadable_document" && e.to_string().contains(".doc)"), "{e}");
        let manifest = br#"<manifest:manifest><manifest:file-entry manifest:full-path="content.xml"><manifest:encryption-data/></manifest:file-entry></manifest:manifest>"#;
        let locked = zip(&[("mimetype", b"application/vnd.oasis.opendocument.text"), ("META-INF/manifest.xml", manifest), ("content.xml", b"\x01\x02")]);
        assert_eq!(extract(&locked, Some("locked.odt"), None).unwrap_err().code(), "encrypted_document");
    }
}

#[cfg(test)]
mod budget_tests {
    use super::*;
    use crate::testing::hostile;

    fn refused(bytes: &[u8], name: &str) -> ExtractError {
        let t0 = std::time::Instant::now();
        let e = extract(bytes, Some(name), None).unwrap_err();
        assert!(t0.elapsed().as_secs_f64() < 5.0, "{name}: refused only after {:?}", t0.elapsed());
        e
    }

    #[test]
    fn nesting_past_the_depth_budget_is_refused_before_parsing() {
        let e = refused(&hostile::nested_html(50_000), "nest.html");
        assert_eq!((e.code(), e.status()), ("document_too_complex", 422), "{e}");
        assert!(e.to_string().contains("nesting depth reached 257; the limit is 256"), "{e}");
        // Stray end tags close nothing (a parser ignores them too), so they do not hide depth.
        let e = refused(&b"<span></x>".repeat(1000), "stray.html");
        assert_eq!(e.code(), "document_too_complex", "{e}");
        // Found by the fuzzer (extract_html): `<!-->` is a whole comment, not the start of one
        // that hides the rest of the page from the scan.
        let e = refused(&[&b"<!-->"[..], &b"<div>".repeat(1000)].concat(), "comment.html");
        assert_eq!(e.code(), "document_too_complex", "{e}");
        let e = refused(&[&b"<!--->"[..], &b"<div>".repeat(1000)].concat(), "comment.html");
        assert_eq!(e.code(), "document_too_complex", "{e}");
        // An HTML element ends the <svg> it is in: `<x/>` opens elements again after it.
        let e = refused(&[&b"<svg><b>"[..], &b"<q/>".repeat(1000)].concat(), "svg.html");
        assert_eq!(e.code(), "document_too_complex", "{e}");
        let e = refused(&hostile::deep_markdown_list(100_000), "list.md");
        assert_eq!(e.code(), "document_too_complex", "{e}");
        let e = refused(&b"> ".repeat(1000), "quote.md");
        assert_eq!(e.code(), "document_too_complex", "{e}");
        // Found by the fuzzer (extract_markdown): CommonMark ends a line at a lone `\r`, so the
        // depth scan must too; read as one line, this list's 2.5 GB of indentation got through.
        let e = refused(&[&b"a\r"[..], &hostile::deep_markdown_list(50_000)].concat(), "cr.md");
        assert_eq!(e.code(), "document_too_complex", "{e}");
        assert!(e.to_string().contains("nesting depth reached 257"), "{e}");
        let e = refused(&hostile::nested_array_pdf(100_000), "nest.pdf");
        assert_eq!(e.code(), "document_too_complex", "{e}");
    }

    #[test]
    fn ordinary_nesting_and_unclosed_tags_are_read() {
        // Deep but within the budget; unclosed paragraphs and list items end themselves.
        let mut html = "<div>".repeat(200);
        html.push_str("deep words");
        html.push_str(&"<p>para <li>item <td>cell".repeat(2000));
        html.push_str("<svg>");
        html.push_str(&"<path d='M0 0'/>".repeat(1000));
        html.push_str("</svg><script>if (a < b) { x('<div>') }</script>");
        let e = extract(html.as_bytes(), Some("ok.html"), None).unwrap();
        assert!(e.text.starts_with("deep words"), "{}", &e.text[..40]);
        let md = "- a\n  - b\n    - c\n> quote\n1. one\n   2. two\n";
        assert!(extract(md.as_bytes(), Some("ok.md"), None).is_ok());
        // A depth scan of a PDF skips strings and stream data.
        let pdf = crate::testing::write_pdf(crate::testing::PdfPages::Text(&["[[[[ ((( ]]] text"]), "T", None).unwrap();
        assert!(extract(&pdf, Some("ok.pdf"), None).is_ok());
    }

    #[test]
    fn pdf_streams_inflate_through_a_bounded_reader() {
        let zeros = hostile::flate_bomb_pdf(b"\0", 64 << 20);
        assert!(zeros.len() < 1 << 20, "{}", zeros.len());
        let e = refused(&zeros, "zeros.pdf");
        assert_eq!((e.code(), e.status()), ("decompression_limit", 413), "{e}");
        assert!(e.to_string().contains("one stream passed 8388608 bytes"), "{e}");
        let ops = hostile::flate_bomb_pdf(b"BT /F1 12 Tf (A) Tj ET\n", 64 << 20);
        assert_eq!(refused(&ops, "ops.pdf").code(), "decompression_limit");
        // The same shape within the budget is read.
        let small = hostile::flate_bomb_pdf(b"BT /F1 12 Tf 72 720 Td (fine words) Tj ET\n", 4 << 10);
        let e = extract(&small, Some("small.pdf"), None).unwrap();
        assert!(e.text.contains("fine words"), "{}", e.text);
        // All streams together have their own budget.
        let limits = Limits { max_inflated_bytes: 1 << 10, ..Limits::default() };
        let e = extract_with(&small, Some("small.pdf"), None, &limits).unwrap_err();
        assert_eq!(e.code(), "decompression_limit", "{e}");
        assert!(e.to_string().contains("all streams"), "{e}");
    }

    /// Inputs the fuzzer found that panic inside the PDF text extractor: contained, each is that
    /// file's `unreadable_pdf`.
    #[test]
    fn fuzz_crashes_stay_the_files_errors() {
        let crash = include_bytes!("../../fuzz/regressions/extract_pdf/crash-944709c2dd82d9f0a3a0e37c1896568cae2447f3");
        let e = extract(crash, Some("crash.pdf"), None).unwrap_err();
        assert_eq!(e.code(), "unreadable_pdf", "{e}");
        // A slow unit (15 s under the fuzzer's sanitizers): a page nested 15,000 deep behind `<!-->`.
        let slow = include_bytes!("../../fuzz/regressions/extract_html/slow-unit-b4b2d85f7e602bd23bc0b42129cf1b3b23d44e03");
        assert_eq!(refused(slow, "slow.html").code(), "document_too_complex");
    }

    /// Found by the fuzzer (extract_pdf, a 20 s timeout): a page that is its own `Parent` sent
    /// the text extractor up its page tree forever. Forms that draw themselves would overflow its
    /// stack (an abort, which no `catch_unwind` contains), and forms each drawing the next twice
    /// double its work at every level: all are refused before it runs.
    #[test]
    fn looping_page_trees_and_runaway_forms_are_refused() {
        use crate::testing::hostile::{form_pdf, self_parent_pdf};
        let timeout = include_bytes!("../../fuzz/regressions/extract_pdf/timeout-22a4a1ceef104214a1fcdbed3f6395361f9970f9");
        for (name, pdf) in [("timeout.pdf", timeout.to_vec()), ("parent.pdf", self_parent_pdf())] {
            let e = extract(&pdf, Some(name), None).unwrap_err();
            assert_eq!(e.code(), "unreadable_pdf", "{e}");
            assert!(e.to_string().contains("page tree loops"), "{e}");
        }
        let itself = refused(&form_pdf(1, 1, Some), "itself.pdf");
        assert!(itself.to_string().contains("form XObject nesting"), "{itself}");
        let each_other = refused(&form_pdf(2, 1, |k| Some(1 - k)), "pair.pdf");
        assert!(each_other.to_string().contains("form XObject nesting"), "{each_other}");
        let doubling = refused(&form_pdf(30, 2, |k| (k + 1 < 30).then_some(k + 1)), "doubling.pdf");
        assert!(doubling.to_string().contains("drawn content operations"), "{doubling}");
        // Forms nested within the budget are read, each time drawn.
        let nested = extract(&form_pdf(3, 2, |k| (k + 1 < 3).then_some(k + 1)), Some("forms.pdf"), None).unwrap();
        assert!(nested.text.contains("plain words"), "{}", nested.text);
        assert_eq!(nested.text.matches("form words").count(), 1 + 2 + 4, "{}", nested.text);
    }

    /// Every filter lopdf decodes, alone and chained, is decoded here under the budget: text
    /// through each reads, and a bomb through each is refused (before, only a stream whose
    /// first filter was Flate was measured, and the extractor inflated the rest unbounded).
    #[test]
    fn lzw_and_ascii85_streams_are_decoded_under_the_budget() {
        use crate::testing::hostile::encoded_pdf;
        let line = b"BT /F1 12 Tf 72 720 Td (chained words) Tj ET\n";
        for filters in [&["LZWDecode"][..], &["ASCII85Decode"], &["ASCII85Decode", "FlateDecode"], &["FlateDecode", "LZWDecode"]] {
            let pdf = encoded_pdf(filters, line, line.len());
            let e = extract(&pdf, Some("chained.pdf"), None).unwrap_or_else(|e| panic!("{filters:?}: {e}"));
            assert!(e.text.contains("chained words"), "{filters:?}: {}", e.text);
        }
        for filters in [&["LZWDecode"][..], &["ASCII85Decode", "FlateDecode"], &["ASCII85Decode", "LZWDecode"]] {
            let pdf = encoded_pdf(filters, b"BT /F1 12 Tf (A) Tj ET\n", 64 << 20);
            assert!(pdf.len() < 8 << 20, "{filters:?}: {}", pdf.len());
            let e = refused(&pdf, "bomb.pdf");
            assert_eq!(e.code(), "decompression_limit", "{filters:?}: {e}");
            assert!(e.to_string().contains("one stream"), "{filters:?}: {e}");
        }
    }

    /// An object stream is inflated by the PDF parser itself, before any budget of ours could
    /// meet it: it is measured in the raw bytes first.
    #[test]
    fn object_stream_bombs_are_refused_before_parsing() {
        use crate::testing::hostile::object_stream_bomb_pdf;
        let pdf = object_stream_bomb_pdf(1 << 30, false);
        assert!(pdf.len() < 4 << 20, "{}", pdf.len());
        let e = refused(&pdf, "objstm.pdf");
        assert_eq!(e.code(), "decompression_limit", "{e}");
        // Disguised from the raw scan (a string holding `stream` in the catalog, one holding
        // `obj` between the object's header and its type): measured as the parser reads it.
        let e = refused(&object_stream_bomb_pdf(1 << 30, true), "disguised.pdf");
        assert_eq!(e.code(), "decompression_limit", "{e}");
    }

    /// The extractor draws an image (`Do`) as if it were a content stream, inflating its data
    /// with no bound: images are blanked before it runs, so an image bomb costs nothing and a
    /// page with a picture keeps its text.
    #[test]
    fn drawn_images_are_not_inflated() {
        let pdf = crate::testing::hostile::image_bomb_pdf(1 << 30);
        assert!(pdf.len() < 2 << 20, "{}", pdf.len());
        let e = extract(&pdf, Some("picture.pdf"), None).unwrap();
        assert!(e.text.contains("plain words"), "{}", e.text);
    }

    #[test]
    fn zip_bombs_and_deep_xml_are_refused_in_bounded_time() {
        use crate::testing::packages::{docx, odt, zip};
        // 64 MiB of one byte deflates to 64 KiB: the member stops inflating past 8 MiB.
        let spaces = vec![b' '; 64 << 20];
        let bomb = zip(&[("word/document.xml", &spaces)]);
        assert!(bomb.len() < 1 << 20, "{}", bomb.len());
        let e = refused(&bomb, "bomb.docx");
        assert_eq!((e.code(), e.status()), ("decompression_limit", 413), "{e}");
        assert!(e.to_string().contains("one archive member passed 8388608 bytes"), "{e}");
        // Members under the per-member budget add up to the total one.
        let limits = Limits { max_inflated_bytes: 1 << 10, ..Limits::default() };
        let e = extract_with(&odt(&"<text:p>words words</text:p>".repeat(100), None), Some("a.odt"), None, &limits).unwrap_err();
        assert!(e.code() == "decompression_limit" && e.to_string().contains("all archive members"), "{e}");
        // Entries past the budget, counted before the archive is opened: a real one and a forged
        // end record that declares 4 billion (ZIP64's count).
        let names: Vec<String> = (0..10_001).map(|i| format!("m{i}")).collect();
        let many = zip(&names.iter().map(|n| (n.as_str(), &b""[..])).collect::<Vec<_>>());
        let e = refused(&many, "many.docx");
        assert_eq!((e.code(), e.status()), ("document_too_complex", 422), "{e}");
        assert!(e.to_string().contains("archive entries reached 10001; the limit is 10000"), "{e}");
        let mut forged = b"PK\x03\x04".to_vec();
        let zip64_at = forged.len() as u64;
        forged.extend(b"PK\x06\x06".iter().chain(&[0u8; 28]).chain(&4_000_000_000u64.to_le_bytes()).chain(&[0u8; 16]));
        forged.extend(b"PK\x06\x07".iter().chain(&[0u8; 4]).chain(&zip64_at.to_le_bytes()).chain(&[0u8; 4]));
        forged.extend(b"PK\x05\x06".iter().chain(&[0u8; 6]).chain(&[0xFF, 0xFF]).chain(&[0u8; 10]));
        let e = refused(&forged, "forged.epub");
        assert!(e.to_string().contains("archive entries reached 4000000000"), "{e}");
        // XML nested 100,000 deep is streamed, never recursed into, and refused at the depth budget.
        let deep = docx(&format!("{}<w:t>x</w:t>", "<w:p>".repeat(100_000)), None);
        let e = refused(&deep, "deep.docx");
        assert_eq!(e.code(), "document_too_complex", "{e}");
        assert!(e.to_string().contains("nesting depth reached 257"), "{e}");
        let deep = crate::testing::packages::epub("Deep", &[("c.xhtml", &"<div>".repeat(100_000))]);
        assert_eq!(refused(&deep, "deep.epub").code(), "document_too_complex");
    }

    #[test]
    fn input_and_output_budgets() {
        let limits = Limits { max_input_bytes: 10, ..Limits::default() };
        let e = extract_with(b"eleven bytes", Some("a.txt"), None, &limits).unwrap_err();
        assert_eq!((e.code(), e.status()), ("document_too_large", 413), "{e}");
        let limits = Limits { max_output_chars: 5, ..Limits::default() };
        let e = extract_with(b"# six chars", Some("a.md"), None, &limits).unwrap_err();
        assert_eq!(e.code(), "document_too_large", "{e}");
        // Markdown stops rendering once its text is over the budget, before the text is whole.
        let limits = Limits { max_output_chars: 1_000, ..Limits::default() };
        let list = "- a\n  - b\n".repeat(10_000);
        let e = extract_with(list.as_bytes(), Some("a.md"), None, &limits).unwrap_err();
        assert_eq!(e.code(), "document_too_large", "{e}");
        assert!(e.to_string().contains("extracted text in characters"), "{e}");
    }
}
