//! Real PDFs for upload and extraction tests, written with lopdf: pages of text, an image-only
//! page, raw content streams, CID fonts; encrypted, or packed into object streams.

use anyhow::Result;

/// What a test PDF holds.
#[derive(Clone, Copy)]
pub enum PdfPages<'a> {
    /// One page per entry, each line of it drawn as text (Helvetica).
    Text(&'a [&'a str]),
    /// One page with only a picture on it: no text layer (a scan).
    ImageOnly,
    /// One page per entry, the entry its content stream as written, uncompressed (Helvetica is
    /// `/F1`): for operators the other variants do not use.
    Content(&'a [&'a str]),
    /// As `Content`, but `/F1` is a CID font (Type 0, Identity-H, no embedded program) whose
    /// two-byte codes 1 to 26 are `a` to `z` through a ToUnicode map, all 500 units wide given as
    /// one width range (`1 26 500`) with a default width of 0, as browsers write them.
    CidContent(&'a [&'a str]),
}

/// A small real PDF, written with lopdf: pages of text (or an image-only page), a `Title` in its
/// information dictionary, and, with `user_password`, encrypted (RC4, 128-bit; an empty user
/// password with an owner password makes an "owner-locked" PDF that opens without one).
pub fn write_pdf(pages: PdfPages, title: &str, user_password: Option<&str>) -> Result<Vec<u8>> {
    pdf_document(pages, title, user_password, false)
}

/// As [`write_pdf`] (unencrypted), saved as PDF 1.5 writers do: its objects packed into object
/// streams behind a cross-reference stream.
pub fn write_pdf_with_object_streams(pages: PdfPages, title: &str) -> Result<Vec<u8>> {
    pdf_document(pages, title, None, true)
}

fn pdf_document(pages: PdfPages, title: &str, user_password: Option<&str>, object_streams: bool) -> Result<Vec<u8>> {
    use lopdf::content::{Content, Operation};
    use lopdf::{dictionary, Document, Object, Stream};
    let mut doc = Document::with_version("1.5");
    let pages_id = doc.new_object_id();
    let font_id = if let PdfPages::CidContent(_) = pages {
        let cmap = "/CIDInit /ProcSet findresource begin 12 dict begin begincmap /CMapName /T def /CMapType 2 def \
            1 begincodespacerange <0000> <FFFF> endcodespacerange 1 beginbfrange <0001> <001A> <0061> endbfrange \
            endcmap CMapName currentdict /CMap defineresource pop end end";
        let to_unicode = doc.add_object(Stream::new(dictionary! {}, cmap.as_bytes().to_vec()));
        let descriptor = doc.add_object(dictionary! {"Type" => "FontDescriptor", "FontName" => "Test", "Flags" => 32,
            "FontBBox" => vec![0.into(), 0.into(), 500.into(), 700.into()], "ItalicAngle" => 0, "Ascent" => 700,
            "Descent" => 0, "CapHeight" => 700, "StemV" => 80});
        let cid_font = doc.add_object(dictionary! {"Type" => "Font", "Subtype" => "CIDFontType2", "BaseFont" => "Test",
            "CIDSystemInfo" => dictionary! {"Registry" => Object::string_literal("Adobe"), "Ordering" => Object::string_literal("Identity"), "Supplement" => 0},
            "FontDescriptor" => descriptor, "CIDToGIDMap" => "Identity", "DW" => 0,
            "W" => vec![1.into(), 26.into(), 500.into()]});
        doc.add_object(dictionary! {"Type" => "Font", "Subtype" => "Type0", "BaseFont" => "Test", "Encoding" => "Identity-H",
            "DescendantFonts" => vec![cid_font.into()], "ToUnicode" => to_unicode})
    } else {
        doc.add_object(dictionary! {"Type" => "Font", "Subtype" => "Type1", "BaseFont" => "Helvetica"})
    };
    let mut image_id = None;
    let compress = !matches!(pages, PdfPages::Content(_) | PdfPages::CidContent(_));
    let contents: Vec<Vec<Operation>> = match pages {
        PdfPages::Content(_) | PdfPages::CidContent(_) => vec![],
        PdfPages::Text(texts) => texts
            .iter()
            .map(|text| {
                let mut ops = vec![
                    Operation::new("BT", vec![]),
                    Operation::new("Tf", vec!["F1".into(), 11.into()]),
                    Operation::new("TL", vec![14.into()]),
                    Operation::new("Td", vec![72.into(), 770.into()]),
                ];
                for line in text.lines() {
                    ops.push(Operation::new("Tj", vec![Object::string_literal(line)]));
                    ops.push(Operation::new("T*", vec![]));
                }
                ops.push(Operation::new("ET", vec![]));
                ops
            })
            .collect(),
        PdfPages::ImageOnly => {
            // An 8x8 grey gradient, drawn over most of the page.
            let pixels: Vec<u8> = (0..64u8).map(|i| i * 4).collect();
            let image = Stream::new(
                dictionary! {"Type" => "XObject", "Subtype" => "Image", "Width" => 8, "Height" => 8,
                             "ColorSpace" => "DeviceGray", "BitsPerComponent" => 8},
                pixels,
            );
            image_id = Some(doc.add_object(image));
            vec![vec![
                Operation::new("q", vec![]),
                Operation::new("cm", vec![400.into(), 0.into(), 0.into(), 600.into(), 100.into(), 100.into()]),
                Operation::new("Do", vec!["Im1".into()]),
                Operation::new("Q", vec![]),
            ]]
        }
    };
    let mut resources = dictionary! {"Font" => dictionary! {"F1" => font_id}};
    if let Some(id) = image_id {
        resources.set("XObject", dictionary! {"Im1" => id});
    }
    let resources_id = doc.add_object(resources);
    let mut kids = Vec::new();
    let mut streams = contents.into_iter().map(|operations| Content { operations }.encode()).collect::<Result<Vec<_>, _>>()?;
    if let PdfPages::Content(raw) | PdfPages::CidContent(raw) = pages {
        streams = raw.iter().map(|c| c.as_bytes().to_vec()).collect();
    }
    for stream in streams {
        let content_id = doc.add_object(Stream::new(dictionary! {}, stream).with_compression(false));
        kids.push(Object::from(doc.add_object(dictionary! {"Type" => "Page", "Parent" => pages_id, "Contents" => content_id})));
    }
    let count = kids.len() as i64;
    let pages = dictionary! {"Type" => "Pages", "Kids" => kids, "Count" => count, "Resources" => resources_id,
                             "MediaBox" => vec![0.into(), 0.into(), 612.into(), 792.into()]};
    doc.objects.insert(pages_id, Object::Dictionary(pages));
    let catalog_id = doc.add_object(dictionary! {"Type" => "Catalog", "Pages" => pages_id});
    let info_id = doc.add_object(dictionary! {"Title" => Object::string_literal(title)});
    doc.trailer.set("Root", catalog_id);
    doc.trailer.set("Info", info_id);
    doc.trailer.set("ID", vec![Object::string_literal("lift-serve-test-0"), Object::string_literal("lift-serve-test-0")]);
    if compress {
        doc.compress();
    }
    if let Some(user) = user_password {
        let version = lopdf::EncryptionVersion::V2 {
            document: &doc,
            owner_password: "owner-secret",
            user_password: user,
            key_length: 128,
            permissions: lopdf::Permissions::all(),
        };
        let state = lopdf::EncryptionState::try_from(version)?;
        doc.encrypt(&state)?;
    }
    let mut out = Vec::new();
    if object_streams {
        doc.save_modern(&mut out)?;
    } else {
        doc.save_to(&mut out)?;
    }
    Ok(out)
}
