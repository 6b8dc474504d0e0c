//! Extraction of real files. PDF text extraction against a corpus of real PDFs
//! (`tests/fixtures/pdf-corpus/corpus.tsv`: LaTeX, LibreOffice, a browser's print-to-PDF, a
//! Debian package's manual): for every file the page count must be the file's, and the
//! word-level agreement with a reference extractor's text (poppler's pdftotext, stored beside the
//! file by `scripts/pdf_corpus_reference.sh`) must be at least 95%, and so must the precision
//! defined below. `cargo test --release --test extraction_corpus -- --nocapture` prints the tables.
//!
//! Word-level agreement: both texts are cut into words at whitespace; each word is lower-cased
//! and stripped of leading and trailing characters that are neither letters nor digits, and a
//! word left empty is dropped. Agreement = the sum over distinct words of min(our count, the
//! reference's count), divided by the reference's number of words: the share of the reference's
//! words, repeats included, that our text has too. "precision" is the same overlap divided by our
//! own number of words (words we have that the reference has not).
//!
//! Word, OpenDocument and EPUB files as LibreOffice writes them (`tests/fixtures/office-corpus/`:
//! one document saved as `.odt`, then exported as `.docx` and `.epub`) are held to the same
//! agreement against the reference text of the PDF LibreOffice made of that same `.odt`.

use lift_serve::formats::{extract, Format};
use serde_json::json;
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

const MIN_AGREEMENT: f64 = 0.95;

fn words(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for w in text.split_whitespace() {
        let w = w.trim_matches(|c: char| !c.is_alphanumeric()).to_lowercase();
        if !w.is_empty() {
            *counts.entry(w).or_insert(0) += 1;
        }
    }
    counts
}

/// (overlap, ours, reference): word counts as defined above.
fn overlap(ours: &str, reference: &str) -> (usize, usize, usize) {
    let (ours, reference) = (words(ours), words(reference));
    let common = reference.iter().map(|(w, n)| (*n).min(ours.get(w).copied().unwrap_or(0))).sum();
    (common, ours.values().sum(), reference.values().sum())
}

#[test]
fn word_agreement_measure() {
    // Case and edge punctuation do not count; a missing or extra word does.
    assert_eq!(overlap("The pier, the PIER.", "the pier the pier"), (4, 4, 4));
    assert_eq!(overlap("the pier", "the pier the pier"), (2, 2, 4));
    assert_eq!(overlap("the pier and more", "the pier"), (2, 4, 2));
    assert_eq!(overlap("-- • ,", ""), (0, 0, 0));
}

fn reference_text(path: &Path) -> String {
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap()).read_to_string(&mut text).unwrap();
    text
}

#[test]
fn real_pdfs_agree_with_the_reference_extractor() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pdf-corpus");
    let list = std::fs::read_to_string(dir.join("corpus.tsv")).unwrap();
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for line in list.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let cols: Vec<&str> = line.split('\t').collect();
        let (file, pages): (&str, usize) = (cols[0], cols[1].parse().unwrap());
        let bytes = std::fs::read(dir.join(file)).unwrap();
        let reference = reference_text(&dir.join(file.replace(".pdf", ".pdftotext.txt.gz")));
        let t0 = std::time::Instant::now();
        let e = extract(&bytes, Some(file), None).unwrap_or_else(|e| panic!("{file}: {e}"));
        let secs = t0.elapsed().as_secs_f64();
        assert_eq!(e.source.format, Format::Pdf);
        let (common, ours, theirs) = overlap(&e.text, &reference);
        let agreement = common as f64 / theirs as f64;
        let precision = common as f64 / ours.max(1) as f64;
        rows.push(format!(
            "| {file} | {} | {} | {theirs} | {ours} | {:.1}% | {:.1}% | {secs:.2} |",
            bytes.len() / 1024,
            e.source.pages.unwrap_or(0),
            agreement * 100.0,
            precision * 100.0
        ));
        if e.source.pages != Some(pages) {
            failures.push(format!("{file}: {:?} pages, the file has {pages}", e.source.pages));
        }
        if agreement < MIN_AGREEMENT {
            failures.push(format!("{file}: agreement {:.1}% < {:.0}%", agreement * 100.0, MIN_AGREEMENT * 100.0));
        }
        // Words split in two or run together show here.
        if precision < MIN_AGREEMENT {
            failures.push(format!("{file}: precision {:.1}% < {:.0}%", precision * 100.0, MIN_AGREEMENT * 100.0));
        }
    }
    println!("| file | KiB | pages | words (reference) | words (ours) | agreement | precision | seconds |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    assert!(rows.len() >= 5, "the corpus lists {} files", rows.len());
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn real_word_opendocument_and_epub_files_agree_with_the_same_document_as_pdf() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let reference = reference_text(&fixtures.join("pdf-corpus/libreoffice-kernel.pdftotext.txt.gz"));
    println!("| file | format | words (reference) | words (ours) | agreement | precision |");
    println!("|---|---|---|---|---|---|");
    for (file, format) in
        [("kernel.en.odt", Format::Odt), ("kernel.en.docx", Format::Docx), ("kernel.en.epub", Format::Epub)]
    {
        let bytes = std::fs::read(fixtures.join("office-corpus").join(file)).unwrap();
        let e = extract(&bytes, Some(file), None).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(e.source.format, format);
        // None of the three has a title of its own: the first heading is the title.
        assert_eq!(e.title.as_deref(), Some("Chapter 10. Debian and the kernel"), "{file}");
        let (common, ours, theirs) = overlap(&e.text, &reference);
        let agreement = common as f64 / theirs as f64;
        println!(
            "| {file} | {} | {theirs} | {ours} | {:.1}% | {:.1}% |",
            json!(format).as_str().unwrap(),
            agreement * 100.0,
            common as f64 / ours.max(1) as f64 * 100.0
        );
        assert!(agreement >= MIN_AGREEMENT, "{file}: agreement {:.1}%", agreement * 100.0);
        // Headings are lines of their own.
        assert!(
            e.text
                .lines()
                .any(|l| l.trim() == "10.1. Can I install and compile a kernel without some Debian-specific tweaking?"),
            "{file}"
        );
    }
}
