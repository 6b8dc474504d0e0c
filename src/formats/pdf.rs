//! PDF: the text layer, page by page, under the depth, object, page and inflation budgets.

use super::{collapse_spaces, ExtractError, Limits};

pub(super) struct PdfText {
    pub text: String,
    pub title: Option<String>,
    pub pages: usize,
}

/// The PDF's text layer, page by page, under `limits`: its nesting depth is measured before it
/// is parsed, its objects and pages counted, and every compressed stream the text extractor may
/// read is first inflated through a bounded reader (so that the extractor's own unbounded
/// inflating only ever meets streams known to fit). A PDF that opens only with a password is
/// refused (one with an empty user password, "owner-locked", opens and is read). The extractor
/// panics on some malformed files: a panic is that file's error, never the server's.
pub(super) fn pdf_to_text(bytes: &[u8], what: &str, limits: &Limits) -> Result<PdfText, ExtractError> {
    let unreadable = |detail: String| ExtractError::UnreadablePdf { what: what.to_string(), detail };
    let complex = |limit, value: u64, max: u64| ExtractError::TooComplex { what: what.to_string(), limit, value, max };
    if !bytes.trim_ascii_start().starts_with(b"%PDF-") {
        return Err(unreadable("it does not start with a PDF header".into()));
    }
    pdf_depth(bytes, limits.max_depth).map_err(|d| complex("nesting depth", d, limits.max_depth))?;
    let caught = std::panic::catch_unwind(|| -> Result<PdfText, ExtractError> {
        // Opening decrypts with the empty user password when that is the password.
        let mut doc = lopdf::Document::load_mem(bytes).map_err(|e| unreadable(e.to_string()))?;
        if doc.is_encrypted() && doc.authenticate_password("").is_err() {
            return Err(ExtractError::EncryptedPdf { what: what.to_string() });
        }
        let objects = doc.objects.len() as u64;
        if objects > limits.max_objects {
            return Err(complex("object count", objects, limits.max_objects));
        }
        pdf_inflate_budget(&doc, what, limits)?;
        let pages: Vec<u32> = doc.get_pages().keys().copied().collect();
        if pages.len() as u64 > limits.max_pages {
            return Err(complex("page count", pages.len() as u64, limits.max_pages));
        }
        spell_out_quote_operators(&mut doc);
        spell_out_cid_width_ranges(&mut doc);
        let mut text = String::new();
        for &n in &pages {
            let mut page = String::new();
            let mut output = pdf_extract::PlainTextOutput::new(&mut page);
            pdf_extract::output_doc_page(&doc, &mut output, n)
                .map_err(|e| unreadable(format!("page {n}: {e}")))?;
            if !text.is_empty() {
                text.push_str("\n\n");
            }
            push_expanding_ligatures(&mut text, &page);
            // Bytes bound characters from above: cheap to check as the text grows.
            if text.len() as u64 > limits.max_output_chars.saturating_mul(4) {
                let value = text.chars().count() as u64;
                return Err(ExtractError::TooLarge {
                    what: what.to_string(),
                    limit: "extracted text in characters",
                    value,
                    max: limits.max_output_chars,
                });
            }
        }
        Ok(PdfText { text, title: pdf_title(&doc), pages: pages.len() })
    });
    caught.unwrap_or_else(|_| Err(unreadable("its structure is malformed (the text extractor gave up)".into())))
}

/// Appends `page` with the Latin ligature characters fonts map glyphs such as "fi" to spelled out
/// as their letters (they are one character to a tokenizer and to a search, not two).
fn push_expanding_ligatures(text: &mut String, page: &str) {
    for c in page.chars() {
        match c {
            '\u{fb00}' => text.push_str("ff"),
            '\u{fb01}' => text.push_str("fi"),
            '\u{fb02}' => text.push_str("fl"),
            '\u{fb03}' => text.push_str("ffi"),
            '\u{fb04}' => text.push_str("ffl"),
            '\u{fb05}' | '\u{fb06}' => text.push_str("st"),
            c => text.push(c),
        }
    }
}

/// Rewrites the text-showing operators `'` and `"` into the ones they stand for (PDF 32000-1,
/// 9.4.3: `s '` is `T* s Tj`; `aw ac s "` is `aw Tw ac Tc s '`), in every page's content
/// streams and every form XObject: the text extractor reads `Tj` and `TJ` only and drops the
/// lines these show. A stream that does not decode is left as it is.
fn spell_out_quote_operators(doc: &mut lopdf::Document) {
    use lopdf::content::{Content, Operation};
    let mut ids: Vec<lopdf::ObjectId> = doc.get_pages().values().flat_map(|&page| doc.get_page_contents(page)).collect();
    ids.extend(doc.objects.iter().filter_map(|(id, object)| match object {
        lopdf::Object::Stream(s) if s.dict.get(b"Subtype").and_then(|n| n.as_name()).is_ok_and(|n| n == b"Form") => Some(*id),
        _ => None,
    }));
    ids.sort_unstable();
    ids.dedup();
    for id in ids {
        let Some(lopdf::Object::Stream(stream)) = doc.objects.get_mut(&id) else { continue };
        let Ok(plain) = stream.get_plain_content() else { continue };
        if !plain.iter().any(|&b| b == b'\'' || b == b'"') {
            continue;
        }
        let Ok(content) = Content::decode(&plain) else { continue };
        if !content.operations.iter().any(|op| op.operator == "'" || op.operator == "\"") {
            continue;
        }
        let mut operations = Vec::with_capacity(content.operations.len() + 8);
        for mut op in content.operations {
            match op.operator.as_str() {
                "'" => {
                    operations.push(Operation::new("T*", vec![]));
                    operations.push(Operation::new("Tj", op.operands));
                }
                "\"" if op.operands.len() == 3 => {
                    let text = op.operands.pop().into_iter().collect();
                    let ac = op.operands.pop().into_iter().collect();
                    operations.push(Operation::new("Tw", op.operands));
                    operations.push(Operation::new("Tc", ac));
                    operations.push(Operation::new("T*", vec![]));
                    operations.push(Operation::new("Tj", text));
                }
                _ => operations.push(op),
            }
        }
        if let Ok(encoded) = (Content { operations }).encode() {
            stream.set_plain_content(encoded);
        }
    }
}

/// Rewrites each CID font's widths given as ranges (`first last width`) into the list form
/// (`first [width …]`): the text extractor misreads the range form and gives those glyphs the
/// default width, so that a browser's PDF (default width 0) comes out with words split in two.
/// At most 2^20 widths are spelled out in all (a CID is two bytes: 2^16 a font covers any one
/// font); ranges past that are dropped and read as before.
fn spell_out_cid_width_ranges(doc: &mut lopdf::Document) {
    use lopdf::Object;
    let is_cid_font = |d: &lopdf::Dictionary| {
        d.get(b"Subtype").and_then(|n| n.as_name()).is_ok_and(|n| n == b"CIDFontType0" || n == b"CIDFontType2")
    };
    let fonts: Vec<lopdf::ObjectId> = doc
        .objects
        .iter()
        .filter_map(|(id, o)| o.as_dict().ok().filter(|d| is_cid_font(d) && d.has(b"W")).map(|_| *id))
        .collect();
    let mut budget = 1u64 << 20;
    for id in fonts {
        let Ok(font) = doc.get_dictionary(id) else { continue };
        let widths = match font.get(b"W") {
            Ok(Object::Reference(r)) => doc.get_object(*r).and_then(|o| o.as_array()).cloned(),
            Ok(w) => w.as_array().cloned(),
            Err(e) => Err(e),
        };
        let Ok(widths) = widths else { continue };
        let (mut out, mut ranges, mut i) = (Vec::with_capacity(widths.len()), 0, 0);
        while i < widths.len() {
            match (widths.get(i), widths.get(i + 1), widths.get(i + 2)) {
                (Some(first), Some(Object::Array(list)), _) => {
                    out.extend([first.clone(), Object::Array(list.clone())]);
                    i += 2;
                }
                (Some(first), Some(last), Some(width)) => {
                    if let (Ok(first), Ok(last), Some(width)) = (first.as_i64(), last.as_i64(), width.as_float().ok()) {
                        let n = last.saturating_sub(first).saturating_add(1).max(0) as u64;
                        if n <= budget {
                            budget -= n;
                            out.extend([Object::Integer(first), Object::Array(vec![Object::Real(width); n as usize])]);
                        }
                    }
                    ranges += 1;
                    i += 3;
                }
                _ => break,
            }
        }
        if ranges > 0 {
            if let Ok(Object::Dictionary(font)) = doc.get_object_mut(id) {
                font.set("W", Object::Array(out));
            }
        }
    }
}

/// Inflates every FlateDecode stream but images' (the text extractor never decodes those)
/// through a reader that stops one byte past the budget: one stream past `max_stream_bytes`, or
/// all of them past `max_inflated_bytes`, refuses the file. A stream that does not inflate is
/// left to the extractor (which reads what it can).
fn pdf_inflate_budget(doc: &lopdf::Document, what: &str, limits: &Limits) -> Result<(), ExtractError> {
    use std::io::Read;
    let mut total = 0u64;
    let mut buf = Vec::new();
    for object in doc.objects.values() {
        let lopdf::Object::Stream(stream) = object else { continue };
        let is_image = stream.dict.get(b"Subtype").and_then(|s| s.as_name()).is_ok_and(|n| n == b"Image");
        let flate = stream.filters().is_ok_and(|f| f.iter().any(|f| *f == b"FlateDecode" || *f == b"Fl"));
        if is_image || !flate {
            continue;
        }
        buf.clear();
        let budget = limits.max_stream_bytes.min(limits.max_inflated_bytes - total);
        let mut reader = flate2::read::ZlibDecoder::new(stream.content.as_slice()).take(budget + 1);
        // A corrupt stream still counts what it gave before the fault.
        let _ = reader.read_to_end(&mut buf);
        let n = buf.len() as u64;
        if n > limits.max_stream_bytes {
            let max = limits.max_stream_bytes;
            return Err(ExtractError::Decompression { what: what.to_string(), limit: "one stream", value: n, max });
        }
        total += n;
        if n > budget {
            let max = limits.max_inflated_bytes;
            return Err(ExtractError::Decompression { what: what.to_string(), limit: "all streams", value: total, max });
        }
    }
    Ok(())
}

/// Refuses a PDF whose arrays and dictionaries nest deeper than `max` (`Err(depth reached)`), by
/// a linear scan of its bytes: strings, comments and stream data are skipped.
fn pdf_depth(pdf: &[u8], max: u64) -> Result<(), u64> {
    let mut depth = 0u64;
    let mut i = 0;
    while i < pdf.len() {
        match pdf[i] {
            b'%' => {
                while i < pdf.len() && pdf[i] != b'\n' && pdf[i] != b'\r' {
                    i += 1;
                }
            }
            b'(' => {
                // A literal string: balanced parentheses, backslash escapes.
                let mut level = 0usize;
                while i < pdf.len() {
                    match pdf[i] {
                        b'\\' => i += 1,
                        b'(' => level += 1,
                        b')' => {
                            level -= 1;
                            if level == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    i += 1;
                }
            }
            b'[' => depth += 1,
            b'<' if pdf.get(i + 1) == Some(&b'<') => {
                depth += 1;
                i += 1;
            }
            b']' => depth = depth.saturating_sub(1),
            b'>' if pdf.get(i + 1) == Some(&b'>') => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            b's' if pdf[i..].starts_with(b"stream") && (i == 0 || !pdf[i - 1].is_ascii_alphabetic()) => {
                i = pdf[i..].windows(9).position(|w| w == b"endstream").map_or(pdf.len(), |p| i + p + 9);
                continue;
            }
            _ => {}
        }
        if depth > max {
            return Err(depth);
        }
        i += 1;
    }
    Ok(())
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
