//! PDF: the text layer, page by page, under the depth, object, page and inflation budgets.

use super::{collapse_spaces, ExtractError, Limits};

pub(super) struct PdfText {
    pub text: String,
    pub title: Option<String>,
    pub pages: usize,
}

/// The PDF's text layer, page by page, under `limits`: its nesting depth is measured before it
/// is parsed, its objects and pages counted, every encoded stream decoded here under the budget
/// (the extractor's own decoders have none), its page trees checked to end and the forms its
/// pages draw to stop (the extractor follows both with no guard). A PDF that opens only with a password is
/// refused (one with an empty user password, "owner-locked", opens and is read). The extractor
/// panics on some malformed files: a panic is that file's error, never the server's.
pub(super) fn pdf_to_text(bytes: &[u8], what: &str, limits: &Limits) -> Result<PdfText, ExtractError> {
    let unreadable = |detail: String| ExtractError::UnreadablePdf { what: what.to_string(), detail };
    let complex = |limit, value: u64, max: u64| ExtractError::TooComplex { what: what.to_string(), limit, value, max };
    if !bytes.trim_ascii_start().starts_with(b"%PDF-") {
        return Err(unreadable("it does not start with a PDF header".into()));
    }
    pdf_depth(bytes, limits.max_depth).map_err(|d| complex("nesting depth", d, limits.max_depth))?;
    pdf_parse_time_streams(bytes, what, limits)?;
    let caught = std::panic::catch_unwind(|| -> Result<PdfText, ExtractError> {
        // Opening decrypts with the empty user password when that is the password.
        let mut doc = load_measuring_object_streams(bytes, limits).map_err(|e| match e {
            LoadError::Parse(e) => unreadable(e.to_string()),
            LoadError::ObjectStream(n) => ExtractError::Decompression {
                what: what.to_string(),
                limit: "one stream",
                value: n,
                max: limits.max_stream_bytes,
            },
        })?;
        if doc.is_encrypted() && doc.authenticate_password("").is_err() {
            return Err(ExtractError::EncryptedPdf { what: what.to_string() });
        }
        let objects = doc.objects.len() as u64;
        if objects > limits.max_objects {
            return Err(complex("object count", objects, limits.max_objects));
        }
        pdf_decode_streams(&mut doc, what, limits)?;
        let pages: Vec<(u32, lopdf::ObjectId)> = doc.get_pages().into_iter().collect();
        if pages.len() as u64 > limits.max_pages {
            return Err(complex("page count", pages.len() as u64, limits.max_pages));
        }
        let page_ids: Vec<lopdf::ObjectId> = pages.iter().map(|&(_, id)| id).collect();
        pdf_page_trees_end(&doc, &page_ids, what)?;
        pdf_drawing_work(&doc, &page_ids, what)?;
        spell_out_quote_operators(&mut doc);
        spell_out_cid_width_ranges(&mut doc);
        let mut text = String::new();
        for &(n, _) in &pages {
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

/// Levels of `Parent` above a page. The text extractor climbs a page's chain for inherited
/// `Resources` and `MediaBox` with no guard: a chain that loops never ends.
const MAX_PAGE_TREE_DEPTH: u64 = 64;
/// Form XObjects drawn inside one another. The extractor draws a form (`Do`) by recursing with
/// no guard: a form that draws itself overflows the stack, an abort no `catch_unwind` contains
/// (it ends the extraction worker, not the server, but the user would learn nothing of why), so
/// it is refused before the extractor runs.
const MAX_FORM_NESTING: u64 = 32;
/// Content-stream operations the extractor runs, each form counted every time it is drawn: a
/// chain of forms each drawing the next twice doubles the work at every level. 2^23 is a few
/// seconds of extraction, and some 1,600 operations on each of the 5,000 pages allowed.
const MAX_DRAWN_OPERATIONS: u64 = 1 << 23;

/// Refuses a PDF in which a page's `Parent` chain loops or climbs past `MAX_PAGE_TREE_DEPTH`.
fn pdf_page_trees_end(doc: &lopdf::Document, pages: &[lopdf::ObjectId], what: &str) -> Result<(), ExtractError> {
    for &page in pages {
        let mut chain = vec![page];
        let mut node = page;
        while let Some(parent) = doc.get_dictionary(node).ok().and_then(|d| d.get(b"Parent").ok()).and_then(|p| p.as_reference().ok()) {
            if chain.contains(&parent) {
                let detail = format!("its page tree loops: object {} {} is its own ancestor", parent.0, parent.1);
                return Err(ExtractError::UnreadablePdf { what: what.to_string(), detail });
            }
            chain.push(parent);
            if chain.len() as u64 > MAX_PAGE_TREE_DEPTH {
                let (value, max) = (chain.len() as u64, MAX_PAGE_TREE_DEPTH);
                return Err(ExtractError::TooComplex { what: what.to_string(), limit: "page tree depth", value, max });
            }
            node = parent;
        }
    }
    Ok(())
}

/// Refuses a PDF whose pages draw form XObjects nested past `MAX_FORM_NESTING` (a form that
/// draws itself among them) or run past `MAX_DRAWN_OPERATIONS` in all, by walking what the text
/// extractor would draw, resolving each `Do` as it does: the name in the current resources'
/// `XObject`, inside a form its own `Resources` if it has them, else the drawer's. A name that
/// does not resolve is left to the extractor (it gives up on the file). Each content stream is
/// decoded once.
fn pdf_drawing_work(doc: &lopdf::Document, pages: &[lopdf::ObjectId], what: &str) -> Result<(), ExtractError> {
    use lopdf::{Dictionary, Object};
    /// A content stream's operation count and the names it draws, in order.
    struct Drawn {
        operations: u64,
        draws: Vec<Vec<u8>>,
    }
    fn read(content: &[u8]) -> Drawn {
        let operations = lopdf::content::Content::decode(content).map(|c| c.operations).unwrap_or_default();
        let draws = operations
            .iter()
            .filter(|op| op.operator == "Do")
            .filter_map(|op| op.operands.first().and_then(|n| n.as_name().ok()).map(<[u8]>::to_vec))
            .collect();
        Drawn { operations: operations.len() as u64, draws }
    }
    fn deref<'a>(doc: &'a lopdf::Document, o: &'a Object) -> Option<&'a Object> {
        match o {
            Object::Reference(id) => doc.get_object(*id).ok(),
            o => Some(o),
        }
    }
    struct Walk<'a> {
        doc: &'a lopdf::Document,
        forms: std::collections::HashMap<lopdf::ObjectId, std::rc::Rc<Drawn>>,
        operations: u64,
    }
    impl<'a> Walk<'a> {
        fn draw(&mut self, drawn: &Drawn, resources: Option<&'a Dictionary>, depth: u64) -> Result<(), (&'static str, u64, u64)> {
            self.operations += drawn.operations;
            if self.operations > MAX_DRAWN_OPERATIONS {
                return Err(("drawn content operations", self.operations, MAX_DRAWN_OPERATIONS));
            }
            let doc = self.doc;
            let xobjects = resources.and_then(|r| r.get(b"XObject").ok()).and_then(|x| deref(doc, x)).and_then(|x| x.as_dict().ok());
            for name in &drawn.draws {
                let Some(entry) = xobjects.and_then(|x| x.get(name).ok()) else { continue };
                let Some(Object::Stream(form)) = deref(doc, entry) else { continue };
                if form.dict.get(b"Subtype").and_then(|s| s.as_name()).is_ok_and(|n| n == b"Image") {
                    continue;
                }
                if depth + 1 > MAX_FORM_NESTING {
                    return Err(("form XObject nesting", depth + 1, MAX_FORM_NESTING));
                }
                let read_form = || std::rc::Rc::new(read(&form.decompressed_content().unwrap_or_else(|_| form.content.clone())));
                let inner = match entry {
                    Object::Reference(id) => self.forms.entry(*id).or_insert_with(read_form).clone(),
                    _ => read_form(),
                };
                let own = form.dict.get(b"Resources").ok().and_then(|r| deref(doc, r)).and_then(|r| r.as_dict().ok());
                self.draw(&inner, own.or(resources), depth + 1)?;
            }
            Ok(())
        }
    }
    let mut walk = Walk { doc, forms: Default::default(), operations: 0 };
    for &page in pages {
        // The page's resources, inherited as the extractor finds them (the chain is known to end).
        let mut node = doc.get_dictionary(page).ok();
        let mut resources = None;
        while let Some(dict) = node {
            if let Some(r) = dict.get(b"Resources").ok().and_then(|r| deref(doc, r)).and_then(|r| r.as_dict().ok()) {
                resources = Some(r);
                break;
            }
            node = dict.get(b"Parent").ok().and_then(|p| p.as_reference().ok()).and_then(|p| doc.get_dictionary(p).ok());
        }
        let content = doc.get_page_content(page).unwrap_or_default();
        walk.draw(&read(&content), resources, 0)
            .map_err(|(limit, value, max)| ExtractError::TooComplex { what: what.to_string(), limit, value, max })?;
    }
    Ok(())
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

enum LoadError {
    Parse(lopdf::Error),
    /// An object stream decoded past `max_stream_bytes` (its size, as far as it was decoded).
    ObjectStream(u64),
}

thread_local! {
    /// `(max_stream_bytes, the largest object stream seen)` of the PDF being parsed on this
    /// thread: lopdf takes its object filter as a plain `fn`, with nowhere else to keep them.
    static OBJECT_STREAMS: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// Parses the PDF with each object stream (`/Type /ObjStm`, which lopdf inflates while it parses,
/// with no bound) decoded first under `max_stream_bytes`: one past it is emptied before lopdf
/// sees it, and refuses the file. This reads the parser's own dictionaries, so it holds where the
/// raw scan ([`pdf_parse_time_streams`]) could be misled by a string that looks like syntax.
fn load_measuring_object_streams(bytes: &[u8], limits: &Limits) -> Result<lopdf::Document, LoadError> {
    fn measure(id: lopdf::ObjectId, object: &mut lopdf::Object) -> Option<(lopdf::ObjectId, lopdf::Object)> {
        if let lopdf::Object::Stream(stream) = object {
            if stream.dict.has_type(b"ObjStm") {
                let (max, largest) = OBJECT_STREAMS.get();
                let filters: Vec<Vec<u8>> = stream.filters().map(|f| f.into_iter().map(<[u8]>::to_vec).collect()).unwrap_or_default();
                let n = decode_bounded(&stream.content, &filters, true, max).map_or(0, |plain| plain.len() as u64);
                OBJECT_STREAMS.set((max, largest.max(n)));
                if n > max {
                    stream.set_plain_content(Vec::new());
                }
            }
        }
        // lopdf keeps the object it passed (a file's own objects, the streams among them) or
        // the one returned (the objects inside an object stream, which are never streams);
        // `None` would drop it.
        match object {
            lopdf::Object::Stream(_) => Some((id, lopdf::Object::Null)),
            other => Some((id, other.clone())),
        }
    }
    OBJECT_STREAMS.set((limits.max_stream_bytes, 0));
    let doc = lopdf::Document::load_mem_with_options(bytes, lopdf::LoadOptions::with_filter(measure));
    let (max, largest) = OBJECT_STREAMS.get();
    if largest > max {
        return Err(LoadError::ObjectStream(largest));
    }
    doc.map_err(LoadError::Parse)
}

/// Measures the streams the PDF parser decodes while it reads the file, before any budget of
/// ours could meet them and with none of its own: cross-reference streams (`/Type /XRef`) and
/// object streams (`/Type /ObjStm`; those are also measured exactly as they are parsed,
/// [`load_measuring_object_streams`]). One linear scan of the raw bytes finds each `stream`
/// keyword and the dictionary before it (from the last `obj` keyword, names' `#xx` escapes undone)
/// and decodes it under the same budget as every other stream. Stream data is scanned too, not
/// skipped, so that a string holding `stream` cannot hide the objects after it; a dictionary that
/// hides its `/Type` behind a string holding `obj` is not caught here (the worker's memory limit
/// still ends it).
fn pdf_parse_time_streams(pdf: &[u8], what: &str, limits: &Limits) -> Result<(), ExtractError> {
    let (mut total, mut object_start, mut i) = (0u64, 0usize, 0usize);
    while i < pdf.len() {
        if pdf[i..].starts_with(b"obj") {
            object_start = i;
        } else if pdf[i..].starts_with(b"stream") && !pdf[..i].ends_with(b"end") {
            let mut start = i + 6;
            start += usize::from(pdf.get(start) == Some(&b'\r'));
            start += usize::from(pdf.get(start) == Some(&b'\n'));
            let end = pdf[start..].windows(9).position(|w| w == b"endstream").map_or(pdf.len(), |p| start + p);
            let dict = unescape_names(&pdf[object_start..i]);
            let contains = |needle: &[u8]| dict.windows(needle.len()).any(|w| w == needle);
            if contains(b"/ObjStm") || contains(b"/XRef") {
                let budget = limits.max_stream_bytes.min(limits.max_inflated_bytes - total);
                let early_change = !contains(b"/EarlyChange 0");
                if let Some(plain) = decode_bounded(&pdf[start..end], &raw_filters(&dict), early_change, budget) {
                    total = count_decoded(plain.len() as u64, total, budget, what, limits)?;
                }
            }
        }
        i += 1;
    }
    Ok(())
}

/// `bytes` with every `#xx` (a name's hex escape) replaced by its byte.
fn unescape_names(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = (bytes[i] == b'#').then(|| bytes.get(i + 1..i + 3)).flatten().and_then(|h| std::str::from_utf8(h).ok()).and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

/// The names of a raw dictionary's `/Filter` (one name or an array of them), in order.
fn raw_filters(dict: &[u8]) -> Vec<Vec<u8>> {
    let Some(at) = dict.windows(7).position(|w| w == b"/Filter") else { return Vec::new() };
    let rest = dict[at + 7..].trim_ascii_start();
    let value = match rest.first() {
        Some(b'[') => &rest[1..rest.iter().position(|&b| b == b']').unwrap_or(rest.len())],
        Some(b'/') => {
            let n = rest[1..].iter().position(|&b| b.is_ascii_whitespace() || b"/[]<>()".contains(&b)).map_or(rest.len(), |p| p + 1);
            &rest[..n]
        }
        _ => return Vec::new(),
    };
    value.split(|&b| b == b'/' || b.is_ascii_whitespace()).filter(|n| !n.is_empty()).map(<[u8]>::to_vec).collect()
}

/// Adds a decoded stream of `n` bytes to `total`: past `max_stream_bytes` alone, or past the
/// `budget` left of `max_inflated_bytes`, it refuses the file.
fn count_decoded(n: u64, total: u64, budget: u64, what: &str, limits: &Limits) -> Result<u64, ExtractError> {
    if n > limits.max_stream_bytes {
        let max = limits.max_stream_bytes;
        return Err(ExtractError::Decompression { what: what.to_string(), limit: "one stream", value: n, max });
    }
    if n > budget {
        let max = limits.max_inflated_bytes;
        return Err(ExtractError::Decompression { what: what.to_string(), limit: "all streams", value: total + n, max });
    }
    Ok(total + n)
}

/// Decodes every encoded stream once, here, under the budget, and puts the plain bytes in its
/// place, so that the text extractor's own decoders (which have no bound) never run: one stream
/// past `max_stream_bytes`, or all of them past `max_inflated_bytes`, refuses the file. Images
/// are blanked instead: the extractor "draws" an image (`Do`) by reading its pixels as if they
/// were a content stream, which inflates an image bomb whole and never yields text. The filters
/// decoded are lopdf's (Flate, LZW, ASCII85, chained in any order); a stream with another filter
/// is left as it is, since the extractor cannot decode it either. A stream with a predictor is
/// measured but left encoded (a predictor never makes data longer). A stream that breaks midway
/// keeps what decoded before the fault.
fn pdf_decode_streams(doc: &mut lopdf::Document, what: &str, limits: &Limits) -> Result<(), ExtractError> {
    let mut total = 0u64;
    for object in doc.objects.values_mut() {
        let lopdf::Object::Stream(stream) = object else { continue };
        if stream.dict.get(b"Subtype").and_then(|s| s.as_name()).is_ok_and(|n| n == b"Image") {
            stream.set_plain_content(Vec::new());
            continue;
        }
        let filters: Vec<Vec<u8>> = match stream.filters() {
            Ok(f) if !f.is_empty() => f.into_iter().map(<[u8]>::to_vec).collect(),
            _ => continue,
        };
        let params = stream.dict.get(b"DecodeParms").and_then(|p| p.as_dict()).ok();
        let early_change = params.and_then(|p| p.get(b"EarlyChange").ok()).and_then(|e| e.as_i64().ok()).is_none_or(|e| e != 0);
        let predicted = params.and_then(|p| p.get(b"Predictor").ok()).and_then(|p| p.as_i64().ok()).is_some_and(|p| p > 1);
        let budget = limits.max_stream_bytes.min(limits.max_inflated_bytes - total);
        let Some(plain) = decode_bounded(&stream.content, &filters, early_change, budget) else { continue };
        total = count_decoded(plain.len() as u64, total, budget, what, limits)?;
        if !predicted {
            stream.set_plain_content(plain);
        }
    }
    Ok(())
}

/// `data` through `filters` in order, each stage stopping one byte past `budget`; `None` when a
/// filter is not one lopdf decodes.
fn decode_bounded(data: &[u8], filters: &[Vec<u8>], early_change: bool, budget: u64) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut data = std::borrow::Cow::Borrowed(data);
    for filter in filters {
        let mut out = Vec::new();
        match filter.as_slice() {
            b"FlateDecode" => {
                // A corrupt stream keeps what it gave before the fault; lopdf retries one that
                // gave nothing as raw deflate (a broken zlib header or checksum), and so does this.
                let _ = flate2::read::ZlibDecoder::new(&data[..]).take(budget + 1).read_to_end(&mut out);
                if out.is_empty() && data.len() > 2 {
                    let _ = flate2::read::DeflateDecoder::new(&data[2..]).take(budget + 1).read_to_end(&mut out);
                }
            }
            b"LZWDecode" => {
                let mut decoder = if early_change {
                    weezl::decode::Decoder::with_tiff_size_switch(weezl::BitOrder::Msb, 8)
                } else {
                    weezl::decode::Decoder::new(weezl::BitOrder::Msb, 8)
                };
                let mut sink = BoundedSink { out: &mut out, room: budget + 1 };
                let _ = decoder.into_stream(&mut sink).decode_all(&data[..]).status;
            }
            b"ASCII85Decode" => ascii85_bounded(&data, budget + 1, &mut out),
            _ => return None,
        }
        let over = out.len() as u64 > budget;
        data = std::borrow::Cow::Owned(out);
        if over {
            break;
        }
    }
    Some(data.into_owned())
}

/// A writer that takes `room` bytes and then fails (so a decoder stops where the budget does).
struct BoundedSink<'a> {
    out: &'a mut Vec<u8>,
    room: u64,
}

impl std::io::Write for BoundedSink<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.room == 0 {
            return Err(std::io::Error::other("stream past its budget"));
        }
        let n = buf.len().min(self.room as usize);
        self.out.extend_from_slice(&buf[..n]);
        self.room -= n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// ASCII85 (PDF 32000-1, 7.4.3) up to `room` bytes, as lopdf reads it: whitespace skipped, `z`
/// four zero bytes, a partial last group padded with `u`, and the first other byte (or `~>`)
/// the end.
fn ascii85_bounded(data: &[u8], room: u64, out: &mut Vec<u8>) {
    let (mut group, mut count) = (0u64, 0usize);
    for &c in data {
        if out.len() as u64 >= room {
            return;
        }
        match c {
            b'z' if count == 0 => out.extend_from_slice(&[0; 4]),
            c if c.is_ascii_whitespace() => {}
            b'!'..=b'u' => {
                group = group * 85 + u64::from(c - b'!');
                count += 1;
                if count == 5 {
                    out.extend_from_slice(&(group as u32).to_be_bytes());
                    (group, count) = (0, 0);
                }
            }
            _ => break,
        }
    }
    if count > 1 {
        for _ in count..5 {
            group = group * 85 + 84;
        }
        out.extend_from_slice(&(group as u32).to_be_bytes()[..count - 1]);
    }
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
