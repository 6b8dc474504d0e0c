//! Documents that are ZIP packages of XML: Word (`.docx`), OpenDocument text (`.odt`) and EPUB.
//! The archive's entry count is read from its end record before it is opened, every part is
//! inflated through a bounded reader, and the XML is streamed (no recursion, depth counted).

use super::{collapse_spaces, html_depth, html_to_text, ExtractError, Limits};
use quick_xml::events::{BytesStart, Event};
use std::io::{Cursor, Read};

pub(super) struct ZippedText {
    pub text: String,
    pub title: Option<String>,
}

/// An open package and what has been inflated from it so far.
struct Package<'a> {
    zip: zip::ZipArchive<Cursor<&'a [u8]>>,
    inflated: u64,
    what: &'a str,
    limits: &'a Limits,
}

impl<'a> Package<'a> {
    /// Opens `bytes` as a ZIP archive, refusing one that declares more entries than the budget
    /// before its central directory is parsed.
    fn open(bytes: &'a [u8], what: &'a str, limits: &'a Limits, kind: &'static str) -> Result<Self, ExtractError> {
        let complex = |value| ExtractError::TooComplex {
            what: what.to_string(),
            limit: "archive entries",
            value,
            max: limits.max_archive_entries,
        };
        if let Some(n) = zip_entry_count(bytes).filter(|n| *n > limits.max_archive_entries) {
            return Err(complex(n));
        }
        let zip = zip::ZipArchive::new(Cursor::new(bytes))
            .map_err(|e| unreadable(what, kind, format!("it is not a ZIP package ({e})")))?;
        if zip.len() as u64 > limits.max_archive_entries {
            return Err(complex(zip.len() as u64));
        }
        Ok(Self { zip, inflated: 0, what, limits })
    }

    /// The title a metadata part names (`dc:title` in `docProps/core.xml` or `meta.xml`), if any.
    fn title(&mut self, part: &str, kind: &'static str) -> Result<Option<String>, ExtractError> {
        match self.read(part, kind)? {
            Some(xml) => first_text_of(&xml, b"title", part, self.what, kind, self.limits),
            None => Ok(None),
        }
    }

    /// One member, inflated through a reader that stops one byte past what the budgets leave;
    /// `None` when the package has no such member.
    fn read(&mut self, name: &str, kind: &'static str) -> Result<Option<Vec<u8>>, ExtractError> {
        let what = self.what;
        let mut entry = match self.zip.by_name(name) {
            Ok(entry) => entry,
            Err(zip::result::ZipError::FileNotFound) => return Ok(None),
            Err(e) => return Err(unreadable(what, kind, format!("{name}: {e}"))),
        };
        let (one, all) = (self.limits.max_stream_bytes, self.limits.max_inflated_bytes);
        let budget = one.min(all.saturating_sub(self.inflated));
        let mut buf = Vec::new();
        (&mut entry)
            .take(budget + 1)
            .read_to_end(&mut buf)
            .map_err(|e| unreadable(what, kind, format!("{name}: {e}")))?;
        let n = buf.len() as u64;
        if n > one {
            return Err(ExtractError::Decompression {
                what: what.to_string(),
                limit: "one archive member",
                value: n,
                max: one,
            });
        }
        self.inflated += n;
        if n > budget {
            return Err(ExtractError::Decompression {
                what: what.to_string(),
                limit: "all archive members",
                value: self.inflated,
                max: all,
            });
        }
        Ok(Some(buf))
    }

    fn require(&mut self, name: &str, kind: &'static str) -> Result<Vec<u8>, ExtractError> {
        let what = self.what;
        self.read(name, kind)?.ok_or_else(|| unreadable(what, kind, format!("it has no {name}")))
    }
}

fn unreadable(what: &str, kind: &'static str, detail: String) -> ExtractError {
    ExtractError::UnreadableDocument { what: what.to_string(), kind, detail }
}

/// The entry count a ZIP's end-of-central-directory record declares (the ZIP64 record's when
/// the classic field is saturated), so that millions of entries are refused unparsed.
fn zip_entry_count(bytes: &[u8]) -> Option<u64> {
    let from = bytes.len().saturating_sub(22 + 65_535);
    let at = bytes[from..].windows(4).rposition(|w| w == b"PK\x05\x06")? + from;
    let eocd = bytes.get(at..at + 22)?;
    let classic = u16::from_le_bytes([eocd[10], eocd[11]]) as u64;
    let zip64 = || -> Option<u64> {
        let locator = bytes.get(at.checked_sub(20)?..at).filter(|l| l.starts_with(b"PK\x06\x07"))?;
        let offset = usize::try_from(u64::from_le_bytes(locator[8..16].try_into().ok()?)).ok()?;
        let record = bytes.get(offset..offset.checked_add(56)?).filter(|r| r.starts_with(b"PK\x06\x06"))?;
        Some(u64::from_le_bytes(record[32..40].try_into().ok()?))
    };
    Some(if classic == 0xFFFF { zip64().unwrap_or(classic) } else { classic })
}

/// What [`walk_xml`] hands the format's reader: element names without their namespace prefix.
enum Xml<'e, 'a> {
    Open(&'e BytesStart<'a>),
    Close(&'e [u8]),
    Text(&'e str),
}

/// Streams one XML part to `visit`. Nesting deeper than `max_depth` refuses the file; entity
/// references resolve to XML's five and to character references (a DTD's own are dropped, never
/// expanded).
fn walk_xml(
    xml: &[u8],
    part: &str,
    what: &str,
    kind: &'static str,
    limits: &Limits,
    mut visit: impl FnMut(Xml<'_, '_>),
) -> Result<(), ExtractError> {
    let mut reader = quick_xml::Reader::from_reader(xml);
    let bad = |e: String| unreadable(what, kind, format!("{part}: {e}"));
    let mut depth = 0u64;
    loop {
        match reader.read_event().map_err(|e| bad(e.to_string()))? {
            Event::Start(e) => {
                depth += 1;
                if depth > limits.max_depth {
                    let max = limits.max_depth;
                    return Err(ExtractError::TooComplex {
                        what: what.to_string(),
                        limit: "nesting depth",
                        value: depth,
                        max,
                    });
                }
                visit(Xml::Open(&e));
            }
            Event::Empty(e) => {
                visit(Xml::Open(&e));
                visit(Xml::Close(e.local_name().as_ref()));
            }
            Event::End(e) => {
                depth = depth.saturating_sub(1);
                visit(Xml::Close(e.local_name().as_ref()));
            }
            Event::Text(t) => visit(Xml::Text(&t.xml_content().map_err(|e| bad(e.to_string()))?)),
            Event::CData(t) => visit(Xml::Text(&String::from_utf8_lossy(&t))),
            Event::GeneralRef(r) => {
                if let Ok(Some(c)) = r.resolve_char_ref() {
                    visit(Xml::Text(c.encode_utf8(&mut [0; 4])));
                } else if let Some(s) = r.decode().ok().and_then(|n| quick_xml::escape::resolve_predefined_entity(&n)) {
                    visit(Xml::Text(s));
                }
            }
            Event::Eof => return Ok(()),
            _ => {}
        }
    }
}

/// An attribute's value by its local name.
fn attr(e: &BytesStart<'_>, local: &[u8]) -> Option<String> {
    e.attributes().flatten().find(|a| a.key.local_name().as_ref() == local).map(|a| {
        let raw = String::from_utf8_lossy(&a.value).into_owned();
        quick_xml::escape::unescape(&raw).map(|s| s.into_owned()).unwrap_or(raw)
    })
}

/// The text of the first element of that local name in a metadata part (`dc:title`).
fn first_text_of(
    xml: &[u8],
    local: &[u8],
    part: &str,
    what: &str,
    kind: &'static str,
    limits: &Limits,
) -> Result<Option<String>, ExtractError> {
    let (mut inside, mut found, mut text) = (false, false, String::new());
    walk_xml(xml, part, what, kind, limits, |x| match x {
        Xml::Open(e) if !found && e.local_name().as_ref() == local => inside = true,
        Xml::Close(n) if inside && n == local => {
            inside = false;
            found = true;
        }
        Xml::Text(t) if inside => text.push_str(t),
        _ => {}
    })?;
    Ok(Some(collapse_spaces(&text)).filter(|t| !t.is_empty()))
}

/// Paragraphs as they are read: headings and paragraphs as blocks, list items and table cells
/// as lines; the first heading is kept as a title.
#[derive(Default)]
struct Lines {
    out: String,
    para: String,
    heading: bool,
    list: bool,
    first_heading: Option<String>,
}

impl Lines {
    fn end_paragraph(&mut self) {
        let para = std::mem::take(&mut self.para);
        let text = para.trim();
        if !text.is_empty() {
            self.out.push_str(if self.heading || !self.list { "\n\n" } else { "\n" });
            self.out.push_str(text);
            if self.heading && self.first_heading.is_none() {
                self.first_heading = Some(collapse_spaces(text));
            }
        }
        (self.heading, self.list) = (false, false);
    }
}

const DOCX: &str = "Word (.docx)";

/// A Word document's body (`word/document.xml`): the text of its runs (`w:t`; deleted text and
/// field codes are other elements and so dropped), tabs and breaks, paragraph by paragraph in
/// document order. Title: the package's `dc:title`, else the first heading (style `Title` or
/// `Heading…`, or an outline level).
pub(super) fn docx_to_text(bytes: &[u8], what: &str, limits: &Limits) -> Result<ZippedText, ExtractError> {
    if is_encrypted_office_file(bytes) {
        return Err(ExtractError::EncryptedDocument { what: what.to_string() });
    }
    if bytes.starts_with(b"\xD0\xCF\x11\xE0") {
        return Err(unreadable(what, DOCX, "it is an older Word (.doc) file; save it as .docx".into()));
    }
    let mut pkg = Package::open(bytes, what, limits, DOCX)?;
    let body = pkg.require("word/document.xml", DOCX)?;
    let mut lines = Lines::default();
    // Tab stops are `w:tab` too, inside the paragraph's properties. A text box comes twice, as
    // the drawing and as its fallback for older readers: the fallback is skipped.
    let (mut in_text, mut in_properties, mut fallback) = (false, false, 0usize);
    walk_xml(&body, "word/document.xml", what, DOCX, limits, |x| match x {
        Xml::Open(e) if fallback > 0 || e.local_name().as_ref() == b"Fallback" => fallback += 1,
        Xml::Close(_) if fallback > 0 => fallback -= 1,
        _ if fallback > 0 => {}
        Xml::Open(e) => match e.local_name().as_ref() {
            b"t" => in_text = true,
            b"pPr" => in_properties = true,
            b"pStyle" => {
                let style = attr(e, b"val").unwrap_or_default().to_ascii_lowercase();
                lines.heading |= style == "title" || style.starts_with("heading");
                lines.list |= style.starts_with("list");
            }
            b"outlineLvl" => lines.heading = true,
            b"numPr" => lines.list = true,
            b"tab" if !in_text && !in_properties => lines.para.push('\t'),
            b"br" | b"cr" => lines.para.push('\n'),
            b"noBreakHyphen" => lines.para.push('-'),
            b"tc" => lines.list = true,
            _ => {}
        },
        Xml::Close(b"t") => in_text = false,
        Xml::Close(b"pPr") => in_properties = false,
        Xml::Close(b"p") => lines.end_paragraph(),
        Xml::Text(t) if in_text => lines.para.push_str(t),
        _ => {}
    })?;
    lines.end_paragraph();
    let title = pkg.title("docProps/core.xml", DOCX)?;
    Ok(ZippedText { text: lines.out, title: title.or(lines.first_heading) })
}

/// An encrypted Office file: an OLE compound file holding an `EncryptionInfo` stream.
fn is_encrypted_office_file(bytes: &[u8]) -> bool {
    const NAME: &[u8] = b"E\0n\0c\0r\0y\0p\0t\0i\0o\0n\0I\0n\0f\0o\0";
    bytes.starts_with(b"\xD0\xCF\x11\xE0\xA1\xB1\x1A\xE1") && bytes.windows(NAME.len()).any(|w| w == NAME)
}

const ODT: &str = "OpenDocument (.odt)";

/// OpenDocument elements whose content is not the body's text: notes, comments, tracked
/// (deleted) changes, declarations.
const ODT_SKIPPED: &[&[u8]] =
    &[b"note", b"annotation", b"tracked-changes", b"sequence-decls", b"variable-decls", b"user-field-decls", b"forms"];

/// An OpenDocument text's body (`content.xml`): headings and paragraphs in document order, with
/// ODF's whitespace rules (runs of spaces collapse; `text:s`, `text:tab` and `text:line-break`
/// are the spaces, tabs and breaks). Title: `meta.xml`'s `dc:title`, else the first heading.
pub(super) fn odt_to_text(bytes: &[u8], what: &str, limits: &Limits) -> Result<ZippedText, ExtractError> {
    let mut pkg = Package::open(bytes, what, limits, ODT)?;
    if pkg.read("META-INF/manifest.xml", ODT)?.is_some_and(|m| m.windows(15).any(|w| w == b"encryption-data")) {
        return Err(ExtractError::EncryptedDocument { what: what.to_string() });
    }
    let content = pkg.require("content.xml", ODT)?;
    let mut lines = Lines::default();
    let (mut in_body, mut skip) = (false, 0usize);
    walk_xml(&content, "content.xml", what, ODT, limits, |x| match x {
        Xml::Open(e) => {
            let name = e.local_name();
            let name = name.as_ref();
            if skip > 0 || ODT_SKIPPED.contains(&name) {
                skip += 1;
                return;
            }
            match name {
                b"body" => in_body = true,
                b"h" => lines.heading = true,
                b"list-item" | b"table-cell" => lines.list = true,
                b"s" => lines
                    .para
                    .push_str(&" ".repeat(attr(e, b"c").and_then(|c| c.parse().ok()).unwrap_or(1usize).min(64))),
                b"tab" => lines.para.push('\t'),
                b"line-break" => lines.para.push('\n'),
                _ => {}
            }
        }
        Xml::Close(name) => {
            if skip > 0 {
                skip -= 1;
                return;
            }
            match name {
                b"body" => in_body = false,
                b"p" | b"h" => lines.end_paragraph(),
                _ => {}
            }
        }
        Xml::Text(t) if in_body && skip == 0 => {
            // ODF collapses whitespace in text like HTML does.
            for (i, word) in t.split(|c: char| c == ' ' || c == '\t' || c == '\n' || c == '\r').enumerate() {
                if i > 0 && !lines.para.ends_with(' ') {
                    lines.para.push(' ');
                }
                lines.para.push_str(word);
            }
        }
        _ => {}
    })?;
    lines.end_paragraph();
    let title = pkg.title("meta.xml", ODT)?;
    Ok(ZippedText { text: lines.out, title: title.or(lines.first_heading) })
}

const EPUB: &str = "EPUB";

/// An EPUB's reading order: the package document named by `META-INF/container.xml`, its spine
/// (items marked `linear="no"` left out), each item's XHTML read as HTML is. Title: the
/// package's `dc:title`, else the first chapter's own title or heading.
pub(super) fn epub_to_text(bytes: &[u8], what: &str, limits: &Limits) -> Result<ZippedText, ExtractError> {
    let mut pkg = Package::open(bytes, what, limits, EPUB)?;
    let container = pkg.require("META-INF/container.xml", EPUB)?;
    let mut opf_path = None;
    walk_xml(&container, "META-INF/container.xml", what, EPUB, limits, |x| {
        if let Xml::Open(e) = x {
            if e.local_name().as_ref() == b"rootfile" && opf_path.is_none() {
                opf_path = attr(e, b"full-path");
            }
        }
    })?;
    let opf_path = opf_path.ok_or_else(|| unreadable(what, EPUB, "its container names no package document".into()))?;
    let opf = pkg.require(&opf_path, EPUB)?;
    let base = opf_path.rsplit_once('/').map_or("", |(dir, _)| dir);
    let (mut manifest, mut spine) = (Vec::new(), Vec::new());
    let (mut in_title, mut title) = (false, None::<String>);
    walk_xml(&opf, &opf_path, what, EPUB, limits, |x| match x {
        Xml::Open(e) => match e.local_name().as_ref() {
            b"item" => {
                if let (Some(id), Some(href)) = (attr(e, b"id"), attr(e, b"href")) {
                    manifest.push((id, href));
                }
            }
            b"itemref" if attr(e, b"linear").as_deref() != Some("no") => spine.extend(attr(e, b"idref")),
            b"title" if title.is_none() => in_title = true,
            _ => {}
        },
        Xml::Close(b"title") if in_title => {
            in_title = false;
            title.get_or_insert_with(String::new);
        }
        Xml::Text(t) if in_title => title.get_or_insert_with(String::new).push_str(t),
        _ => {}
    })?;
    let encrypted = pkg.read("META-INF/encryption.xml", EPUB)?.unwrap_or_default();
    let mut text = String::new();
    let mut first_heading = None;
    for idref in &spine {
        let Some((_, href)) = manifest.iter().find(|(id, _)| id == idref) else { continue };
        let path = join_href(base, href);
        if encrypted.windows(path.len() + 5).any(|w| w.starts_with(b"URI=\"") && &w[5..] == path.as_bytes()) {
            return Err(ExtractError::EncryptedDocument { what: what.to_string() });
        }
        let Some(xhtml) = pkg.read(&path, EPUB)? else { continue };
        html_depth(&xhtml, limits.max_depth).map_err(|value| ExtractError::TooComplex {
            what: what.to_string(),
            limit: "nesting depth",
            value,
            max: limits.max_depth,
        })?;
        let (chapter, heading) = html_to_text(&String::from_utf8_lossy(&xhtml));
        if first_heading.is_none() {
            first_heading = heading.filter(|h| !h.is_empty());
        }
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str(&chapter);
        // Bytes bound characters from above: cheap to check as the text grows.
        if text.len() as u64 > limits.max_output_chars.saturating_mul(4) {
            let value = text.chars().count() as u64;
            let max = limits.max_output_chars;
            return Err(ExtractError::TooLarge {
                what: what.to_string(),
                limit: "extracted text in characters",
                value,
                max,
            });
        }
    }
    let title = title.map(|t| collapse_spaces(&t)).filter(|t| !t.is_empty());
    Ok(ZippedText { text, title: title.or(first_heading) })
}

/// A manifest `href` (relative to the package document, percent-encoded, maybe with a fragment)
/// as the archive member's name.
fn join_href(base: &str, href: &str) -> String {
    let href = href.split('#').next().unwrap_or_default();
    let decoded = percent_decode(href);
    let mut parts: Vec<&str> = if base.is_empty() { Vec::new() } else { base.split('/').collect() };
    for part in decoded.split('/') {
        match part {
            "." | "" => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    parts.join("/")
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1).and_then(|b| hex(*b)), bytes.get(i + 2).and_then(|b| hex(*b))) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
