//! Hostile uploads (issue 44): files made to hurt an extractor. `scripts/fuzz_corpus.py` writes
//! the same shapes as seeds of the fuzz corpus.

use std::io::Write;

/// `<div>` opened `depth` times, never closed.
pub fn nested_html(depth: usize) -> Vec<u8> {
    b"<div>".repeat(depth)
}

/// A Markdown list nested `depth` deep on one line (`- - - … x`).
pub fn deep_markdown_list(depth: usize) -> Vec<u8> {
    let mut md = b"- ".repeat(depth);
    md.extend_from_slice(b"x\n");
    md
}

/// A one-page PDF whose FlateDecode page content inflates to `inflated` bytes: `unit`
/// repeated (`b"\0"` for a bomb of zeros, `b"BT /F1 12 Tf (A) Tj ET\n"` for one of text
/// operators).
pub fn flate_bomb_pdf(unit: &[u8], inflated: usize) -> Vec<u8> {
    pdf(b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(), Some(&zlib_of_repeated(unit, inflated)))
}

/// A PDF whose catalog holds an array nested `depth` deep.
pub fn nested_array_pdf(depth: usize) -> Vec<u8> {
    let mut catalog = b"<< /Type /Catalog /Pages 2 0 R /Nest ".to_vec();
    catalog.extend(b"[".repeat(depth));
    catalog.extend(b"]".repeat(depth));
    catalog.extend_from_slice(b" >>");
    pdf(catalog, None)
}

/// Found by the fuzzer (extract_pdf): a page that is its own `Parent`.
pub fn self_parent_pdf() -> Vec<u8> {
    let mut objects = standard_objects(b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(), None);
    objects[2] = b"<< /Type /Page /Parent 3 0 R /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>".to_vec();
    write_objects(&objects)
}

/// A page that draws form XObject 1 of `forms`; form `k` shows a word and draws form
/// `next(k)` (an object number among 6.., or none) `draws` times. `next(k) = k` is a form
/// that draws itself; a chain whose forms each draw the next twice is work doubling at every
/// level.
pub fn form_pdf(forms: usize, draws: usize, next: impl Fn(usize) -> Option<usize>) -> Vec<u8> {
    let mut objects = standard_objects(b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(), None);
    objects[2] = b"<< /Type /Page /Parent 2 0 R /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> /XObject << /X 6 0 R >> >> >>".to_vec();
    objects[3] = stream_object_with("", b"BT /F1 12 Tf 72 720 Td (plain words) Tj ET /X Do");
    for k in 0..forms {
        let (draw, xobjects) = match next(k) {
            Some(n) => ("/X Do ".repeat(draws), format!("/XObject << /X {} 0 R >>", 6 + n)),
            None => (String::new(), String::new()),
        };
        let content = format!("BT /F1 12 Tf 72 700 Td (form words) Tj ET {draw}");
        let form = format!("/Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << /Font << /F1 5 0 R >> {xobjects} >>");
        objects.push(stream_object_with(&form, content.as_bytes()));
    }
    write_objects(&objects)
}

/// A page that draws (`Do`) an image whose FlateDecode data inflates to `inflated` zeros.
pub fn image_bomb_pdf(inflated: usize) -> Vec<u8> {
    let mut objects = standard_objects(b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(), None);
    objects[2] = b"<< /Type /Page /Parent 2 0 R /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> /XObject << /Im 6 0 R >> >> >>".to_vec();
    objects[3] = stream_object_with("", b"BT /F1 12 Tf 72 720 Td (plain words) Tj ET q 612 0 0 792 0 0 cm /Im Do Q");
    let image = format!("/Type /XObject /Subtype /Image /Width 1024 /Height {} /ColorSpace /DeviceGray /BitsPerComponent 8 /Filter /FlateDecode", inflated / 1024);
    objects.push(stream_object_with(&image, &zlib_of_repeated(b"\0", inflated)));
    write_objects(&objects)
}

/// A one-page PDF whose content stream is `unit` repeated to `len` bytes, encoded with
/// `filters` (`FlateDecode`, `LZWDecode`, `ASCII85Decode`, listed in decoding order).
pub fn encoded_pdf(filters: &[&str], unit: &[u8], len: usize) -> Vec<u8> {
    let mut data: Vec<u8> = unit.iter().copied().cycle().take(len).collect();
    for filter in filters.iter().rev() {
        data = match *filter {
            "FlateDecode" => {
                let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
                let _ = z.write_all(&data);
                z.finish().unwrap_or_default()
            }
            "LZWDecode" => weezl::encode::Encoder::with_tiff_size_switch(weezl::BitOrder::Msb, 8).encode(&data).unwrap_or_default(),
            "ASCII85Decode" => ascii85(&data),
            other => panic!("no encoder for {other}"),
        };
    }
    let names: String = filters.iter().map(|f| format!("/{f} ")).collect();
    let mut objects = standard_objects(b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(), None);
    objects[3] = stream_object_with(&format!("/Filter [ {names}]"), &data);
    write_objects(&objects)
}

/// ASCII85 with `z` for four zero bytes and the `~>` end marker.
fn ascii85(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() * 5 / 4 + 8);
    for chunk in data.chunks(4) {
        let mut group = [0u8; 4];
        group[..chunk.len()].copy_from_slice(chunk);
        let mut n = u32::from_be_bytes(group);
        if n == 0 && chunk.len() == 4 {
            out.push(b'z');
            continue;
        }
        let mut digits = [0u8; 5];
        for d in digits.iter_mut().rev() {
            *d = b'!' + (n % 85) as u8;
            n /= 85;
        }
        out.extend_from_slice(&digits[..chunk.len() + 1]);
    }
    out.extend_from_slice(b"~>");
    out
}

/// A one-page PDF with an object stream (`/Type /ObjStm`, read while the file is parsed)
/// whose FlateDecode data inflates to `inflated` bytes of spaces; `disguised`: with strings
/// that look like syntax to a byte scan (`(stream)` in the catalog, `(obj)` between the
/// stream's `/Type` and its data).
pub fn object_stream_bomb_pdf(inflated: usize, disguised: bool) -> Vec<u8> {
    let note = if disguised { "/Note (obj) " } else { "" };
    let o = stream_object_with(&format!("/Type /ObjStm {note}/N 1 /First 4 /Filter /FlateDecode"), &zlib_of_repeated(b" ", inflated));
    let catalog: &[u8] = if disguised { b"<< /Type /Catalog /Pages 2 0 R /Note (stream) >>" } else { b"<< /Type /Catalog /Pages 2 0 R >>" };
    let mut objects = standard_objects(catalog.to_vec(), None);
    objects.push(o);
    write_objects(&objects)
}

/// Objects 1 (the catalog given), 2 (pages), 3 (page), 4 (content: `stream` compressed,
/// or a line of text), 5 (font), with a correct cross-reference table.
fn pdf(catalog: Vec<u8>, stream: Option<&[u8]>) -> Vec<u8> {
    write_objects(&standard_objects(catalog, stream))
}

fn standard_objects(catalog: Vec<u8>, stream: Option<&[u8]>) -> Vec<Vec<u8>> {
    let mut objects: Vec<Vec<u8>> = vec![catalog];
    objects.push(b"<< /Type /Pages /Kids [3 0 R] /Count 1 /MediaBox [0 0 612 792] >>".to_vec());
    objects.push(b"<< /Type /Page /Parent 2 0 R /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>".to_vec());
    objects.push(match stream {
        Some(s) => stream_object_with("/Filter /FlateDecode", s),
        None => stream_object_with("", b"BT /F1 12 Tf 72 720 Td (plain words) Tj ET"),
    });
    objects.push(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>".to_vec());
    objects
}

/// A stream object holding `data` as it is, its dictionary `entries` and its `/Length`.
fn stream_object_with(entries: &str, data: &[u8]) -> Vec<u8> {
    let mut o = format!("<< {entries} /Length {} >>\nstream\n", data.len()).into_bytes();
    o.extend_from_slice(data);
    o.extend_from_slice(b"\nendstream");
    o
}

/// `unit` repeated to `len` bytes, zlib-compressed (default level) a MiB at a time.
fn zlib_of_repeated(unit: &[u8], len: usize) -> Vec<u8> {
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    let chunk = unit.repeat((1 << 20) / unit.len().max(1) + 1);
    let mut left = len;
    while left > 0 {
        let n = left.min(chunk.len());
        let _ = z.write_all(&chunk[..n]);
        left -= n;
    }
    z.finish().unwrap_or_default()
}

/// Objects numbered from 1 in order, a correct cross-reference table, catalog 1.
fn write_objects(objects: &[Vec<u8>]) -> Vec<u8> {
    let mut out = b"%PDF-1.5\n".to_vec();
    let mut offsets = Vec::new();
    for (i, body) in objects.iter().enumerate() {
        offsets.push(out.len());
        out.extend(format!("{} 0 obj\n", i + 1).into_bytes());
        out.extend_from_slice(body);
        out.extend_from_slice(b"\nendobj\n");
    }
    let xref = out.len();
    out.extend(format!("xref\n0 {}\n0000000000 65535 f \n", objects.len() + 1).into_bytes());
    for o in offsets {
        out.extend(format!("{o:010} 00000 n \n").into_bytes());
    }
    out.extend(format!("trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n", objects.len() + 1).into_bytes());
    out
}
