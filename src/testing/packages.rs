//! Small real Word, OpenDocument and EPUB files, packaged with the zip crate as their writers
//! package them (an ODF's or EPUB's `mimetype` first and stored).

use std::io::Write;

/// A ZIP of these members, in order; a member named `mimetype` is stored, the rest deflated.
pub fn zip(members: &[(&str, &[u8])]) -> Vec<u8> {
    use zip::write::SimpleFileOptions;
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for (name, data) in members {
        let method = if *name == "mimetype" { zip::CompressionMethod::Stored } else { zip::CompressionMethod::Deflated };
        w.start_file(*name, SimpleFileOptions::default().compression_method(method)).unwrap();
        w.write_all(data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

/// A `.docx` whose body is `body` (the `w:body` element's content) and, when given, whose
/// `docProps/core.xml` has that title.
pub fn docx(body: &str, title: Option<&str>) -> Vec<u8> {
    let document = format!(
        r#"<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body>{body}</w:body></w:document>"#
    );
    let core = title.map(|t| {
        format!(r#"<?xml version="1.0"?><cp:coreProperties xmlns:cp="http://schemas.openxmlformats.org/package/2006/metadata/core-properties" xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>{t}</dc:title></cp:coreProperties>"#)
    });
    let types = r#"<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types"><Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/></Types>"#;
    let mut members: Vec<(&str, &[u8])> = vec![("[Content_Types].xml", types.as_bytes()), ("word/document.xml", document.as_bytes())];
    if let Some(core) = &core {
        members.push(("docProps/core.xml", core.as_bytes()));
    }
    zip(&members)
}

/// A Word paragraph of one run; `style` as `w:pStyle` (`Heading1`, `Title`, …).
pub fn docx_paragraph(text: &str, style: Option<&str>) -> String {
    let props = style.map_or(String::new(), |s| format!(r#"<w:pPr><w:pStyle w:val="{s}"/></w:pPr>"#));
    format!(r#"<w:p>{props}<w:r><w:t xml:space="preserve">{text}</w:t></w:r></w:p>"#)
}

/// An `.odt` whose `office:text` holds `body`, with that title in `meta.xml` when given.
pub fn odt(body: &str, title: Option<&str>) -> Vec<u8> {
    let ns = r#"xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" xmlns:table="urn:oasis:names:tc:opendocument:xmlns:table:1.0" xmlns:dc="http://purl.org/dc/elements/1.1/""#;
    let content = format!(r#"<?xml version="1.0" encoding="UTF-8"?><office:document-content {ns}><office:body><office:text>{body}</office:text></office:body></office:document-content>"#);
    let meta = title.map(|t| format!(r#"<?xml version="1.0"?><office:document-meta {ns}><office:meta><dc:title>{t}</dc:title></office:meta></office:document-meta>"#));
    let manifest = r#"<?xml version="1.0"?><manifest:manifest xmlns:manifest="urn:oasis:names:tc:opendocument:xmlns:manifest:1.0"><manifest:file-entry manifest:full-path="/" manifest:media-type="application/vnd.oasis.opendocument.text"/></manifest:manifest>"#;
    let mut members: Vec<(&str, &[u8])> = vec![
        ("mimetype", b"application/vnd.oasis.opendocument.text"),
        ("content.xml", content.as_bytes()),
        ("META-INF/manifest.xml", manifest.as_bytes()),
    ];
    if let Some(meta) = &meta {
        members.push(("meta.xml", meta.as_bytes()));
    }
    zip(&members)
}

/// An EPUB 3 of these chapters (`(file name, body HTML)`, in reading order) under `OEBPS/`,
/// plus a navigation document left out of the reading order (`linear="no"`).
pub fn epub(title: &str, chapters: &[(&str, &str)]) -> Vec<u8> {
    let container = r#"<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/></rootfiles></container>"#;
    let mut items = String::from(r#"<item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>"#);
    let mut spine = String::from(r#"<itemref idref="nav" linear="no"/>"#);
    let mut files = vec![("OEBPS/nav.xhtml".to_string(), xhtml("Contents", "<nav><ol><li>Contents entry</li></ol></nav>"))];
    // Listed in the manifest in reverse: the spine, not the manifest, is the reading order.
    for (i, (name, body)) in chapters.iter().enumerate().rev() {
        items.push_str(&format!(r#"<item id="c{i}" href="{}" media-type="application/xhtml+xml"/>"#, name.replace(' ', "%20")));
        files.push((format!("OEBPS/{name}"), xhtml(name, body)));
    }
    for i in 0..chapters.len() {
        spine.push_str(&format!(r#"<itemref idref="c{i}"/>"#));
    }
    let opf = format!(
        r#"<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0" unique-identifier="id"><metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:identifier id="id">test</dc:identifier><dc:title>{title}</dc:title><dc:language>en</dc:language></metadata><manifest>{items}</manifest><spine>{spine}</spine></package>"#
    );
    let mut members: Vec<(&str, &[u8])> =
        vec![("mimetype", b"application/epub+zip"), ("META-INF/container.xml", container.as_bytes()), ("OEBPS/content.opf", opf.as_bytes())];
    members.extend(files.iter().map(|(n, d)| (n.as_str(), d.as_bytes())));
    zip(&members)
}

fn xhtml(title: &str, body: &str) -> String {
    format!(r#"<?xml version="1.0" encoding="UTF-8"?><!DOCTYPE html><html xmlns="http://www.w3.org/1999/xhtml"><head><title>{title}</title></head><body>{body}</body></html>"#)
}
