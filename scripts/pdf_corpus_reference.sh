#!/usr/bin/env bash
# Writes the reference text of each PDF in tests/fixtures/pdf-corpus/ with poppler's pdftotext
# (NAME.pdftotext.txt.gz beside NAME.pdf), which tests/extraction_corpus.rs compares our extraction to.
# Run once when a file joins the corpus; the test itself needs no reference extractor.
# Needs poppler-utils (pdftotext, pdfinfo).
set -euo pipefail
cd "$(dirname "$0")/../tests/fixtures/pdf-corpus"
for pdf in *.pdf; do
  name=${pdf%.pdf}
  pdftotext -enc UTF-8 "$pdf" - | gzip -9n > "$name.pdftotext.txt.gz"
  printf '%s\t%s pages\t%s\n' "$pdf" "$(pdfinfo "$pdf" | awk '/^Pages:/ {print $2}')" "$(pdftotext -v 2>&1 | head -1)"
done
