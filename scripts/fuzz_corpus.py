#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (fuzz/corpus/<target>/): ordinary files of each
format and the hostile ones — nested HTML, a PDF whose FlateDecode page stream
inflates to 1 GiB of text operators, one inflating to 1 GiB of zeros, a nested-array PDF,
forms drawing forms, a drawn image, an object stream, chained stream filters, a 100k-deep
Markdown list — plus Word, OpenDocument and EPUB packages (one a ZIP bomb), multipart and JSON bodies (one with a duplicate key).
Usage: scripts/fuzz_corpus.py [out_dir] (default fuzz/corpus)."""
import base64
import io
import os
import sys
import zipfile
import zlib

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "fuzz", "corpus")


def put(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def plain_stream(dict_entries, data):
    return b"<< %s /Length %d >>\nstream\n" % (dict_entries, len(data)) + data + b"\nendstream"


def pdf(catalog, stream=None, text=b"BT /F1 12 Tf 72 720 Td (plain words) Tj ET", xobjects=b"", extra=()):
    """Catalog, pages, page (drawing `xobjects`), content (FlateDecode `stream`, or `text`),
    font, then the `extra` objects (6, 7, ...); with xref."""
    if stream is None:
        content = plain_stream(b"", text)
    else:
        content = b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream"
    objects = [
        catalog,
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 /MediaBox [0 0 612 792] >>",
        b"<< /Type /Page /Parent 2 0 R /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> %s >> >>" % xobjects,
        content,
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        *extra,
    ]
    body, offsets = b"%PDF-1.5\n", []
    for i, o in enumerate(objects):
        offsets.append(len(body))
        body += b"%d 0 obj\n" % (i + 1) + o + b"\nendobj\n"
    xref = len(body)
    body += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    body += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    body += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return body


def bomb(unit, inflated):
    z = zlib.compressobj(6)
    chunk = unit * ((1 << 20) // len(unit) + 1)
    parts, left = [], inflated
    while left > 0:
        n = min(left, len(chunk))
        parts.append(z.compress(chunk[:n]))
        left -= n
    parts.append(z.flush())
    return b"".join(parts)


catalog = b"<< /Type /Catalog /Pages 2 0 R >>"
put("extract_text", "plain.txt", "The harbor of Velmora was built in 1843.\n")
put("extract_markdown", "doc.md", "# Title\n\n- a\n  - b\n\n> quote\n\n1. one\n")
put("extract_markdown", "deep_list.md", "- " * 100_000 + "x\n")
put("extract_markdown", "deep_list_after_cr.md", "a\r" + "- " * 50_000 + "x\n")  # found by the fuzzer: a lone \r ends a line
put("extract_html", "page.html", "<!doctype html><title>T</title><p>words<ul><li>a</ul><script>x<y</script>")
put("extract_html", "nested.html", "<div>" * 50_000)
put("extract_pdf", "plain.pdf", pdf(catalog))
put("extract_pdf", "bomb_text_ops.pdf", pdf(catalog, bomb(b"BT /F1 12 Tf (A) Tj ET\n", 1 << 30)))
put("extract_pdf", "bomb_zeros.pdf", pdf(catalog, bomb(b"\0", 1 << 30)))
put("extract_pdf", "nested_array.pdf", pdf(b"<< /Type /Catalog /Pages 2 0 R /Nest " + b"[" * 100_000 + b"]" * 100_000 + b" >>"))
put("extract_pdf", "quote_operators.pdf", pdf(catalog, b"BT /F1 12 Tf 14 TL 72 720 Td (a) Tj (b) ' 1 0 (c) \" ET"))
# Forms drawing forms (6 draws 7 twice, 7 draws 8 twice), a drawn image, an object stream, an
# LZW-and-ASCII85 chain: the shapes the extractor follows or decodes with no guard of its own.
form = lambda nxt: plain_stream(
    b"/Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << /Font << /F1 5 0 R >>%s >>" % (b" /XObject << /X %d 0 R >>" % nxt if nxt else b""),
    b"BT /F1 12 Tf 72 700 Td (form words) Tj ET" + (b" /X Do /X Do" if nxt else b""))
put("extract_pdf", "forms.pdf", pdf(catalog, text=b"BT /F1 12 Tf 72 720 Td (plain words) Tj ET /X Do", xobjects=b"/XObject << /X 6 0 R >>", extra=(form(7), form(8), form(None))))
image = zlib.compress(b"\0" * 4096)
put("extract_pdf", "image.pdf", pdf(catalog, text=b"BT /F1 12 Tf 72 720 Td (plain words) Tj ET q 64 0 0 64 0 0 cm /Im Do Q", xobjects=b"/XObject << /Im 6 0 R >>",
    extra=(b"<< /Type /XObject /Subtype /Image /Width 64 /Height 64 /ColorSpace /DeviceGray /BitsPerComponent 8 /Filter /FlateDecode /Length %d >>\nstream\n" % len(image) + image + b"\nendstream",)))
objstm = zlib.compress(b"7 0 << /Kind /Packed >>")
put("extract_pdf", "object_stream.pdf", pdf(catalog, extra=(b"<< /Type /ObjStm /N 1 /First 4 /Filter /FlateDecode /Length %d >>\nstream\n" % len(objstm) + objstm + b"\nendstream",)))
a85 = base64.a85encode(zlib.compress(b"BT /F1 12 Tf 72 720 Td (chained words) Tj ET"), adobe=False) + b"~>"
put("extract_pdf", "chained_filters.pdf", pdf(catalog, text=b"/X Do", xobjects=b"/XObject << /X 6 0 R >>",
    extra=(plain_stream(b"/Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << /Font << /F1 5 0 R >> >> /Filter [ /ASCII85Decode /FlateDecode ]", a85),)))


def package(members):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members:
            z.writestr(name, data, zipfile.ZIP_STORED if name == "mimetype" else zipfile.ZIP_DEFLATED)
    return buf.getvalue()


W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
put("extract_zipped", "doc.docx", package([("word/document.xml", f'<w:document {W}><w:body><w:p><w:pPr><w:pStyle w:val="Heading1"/>'
    '</w:pPr><w:r><w:t>Title</w:t></w:r></w:p><w:p><w:r><w:t>a &amp; b</w:t><w:tab/></w:r></w:p></w:body></w:document>')]))
put("extract_zipped", "doc.odt", package([("mimetype", "application/vnd.oasis.opendocument.text"), ("content.xml",
    '<office:document-content xmlns:office="o" xmlns:text="t"><office:body><office:text><text:h>T</text:h>'
    '<text:p>a<text:s text:c="3"/>b</text:p></office:text></office:body></office:document-content>')]))
put("extract_zipped", "book.epub", package([("mimetype", "application/epub+zip"),
    ("META-INF/container.xml", '<container><rootfiles><rootfile full-path="o/p.opf"/></rootfiles></container>'),
    ("o/p.opf", '<package><metadata><title>B</title></metadata><manifest><item id="c" href="c%201.xhtml"/></manifest>'
     '<spine><itemref idref="c"/></spine></package>'),
    ("o/c 1.xhtml", "<html><body><h1>One</h1><p>words</p></body></html>")]))
put("extract_zipped", "bomb.docx", package([("word/document.xml", b" " * (64 << 20))]))
put("multipart", "form.txt", "--X\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n"
    "Content-Type: text/plain\r\n\r\nwords\r\n--X\r\nContent-Disposition: form-data; name=\"options\"\r\n\r\n"
    "{\"window\":64}\r\n--X--\r\n")
put("request_bodies", "document.json", '{"text":"words","title":"t","options":{"window":64,"epochs":[1,2]}}')
put("request_bodies", "duplicate.json", '{"text":"a","text":"b"}')
put("request_bodies", "ask.json", '{"document_id":"doc_x","question":"q","mode":"lift","max_tokens":4}')
put("request_bodies", "chat.json", '{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}')
print(os.path.abspath(out))
