#!/usr/bin/env python3
"""Rebuild and check the real-text QA set in data/real-text/questions.jsonl.

Every document of the set is a contiguous excerpt of a text that a Debian
package ships (a plain or gzip-compressed text file, or a man page rendered
to plain text).  The recipe for each document (package, path inside the
package, how it is rendered, where the excerpt starts and ends) is kept in
RECIPES below; the questions themselves live only in questions.jsonl.

Usage:
    python3 scripts/real_text/build.py               # download, re-extract, compare, check
    python3 scripts/real_text/build.py --check-only  # only check questions.jsonl (offline)
    python3 scripts/real_text/build.py --write-texts DIR   # also write each re-extracted text

The full run needs `apt-get download` (Debian's package registry) and
`dpkg-deb`; man pages are rendered with man-db's `man -l` and `col -bx`.
A package whose version differs from the recorded one only gives a
warning; a text that differs from the committed document is reported and
makes the run fail only when the version is the recorded one.

Standard library only (Python 3.11).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ROOT / "data" / "real-text" / "questions.jsonl"

# Estimate used throughout the set: one SmolLM2 token per 4.2 characters of English.
CHARS_PER_TOKEN = 4.2

KINDS = {
    "who", "what", "which", "when", "where", "how_many", "definition",
    "condition", "consequence", "why", "other",
}
SPLITS = ("train", "validation", "eval")
# Minimum sizes of each split: (documents, questions).
SPLIT_MINIMA = {"train": (4, 80), "validation": (3, 60), "eval": (5, 110)}

# render: "text" (plain file), "gzip" (gzip-compressed text), "man" (man page,
# rendered with `LC_ALL=C MANWIDTH=80 man --nj --nh -l FILE | col -bx`).
# start / end: the excerpt runs from the first line equal to `start` (after
# trailing whitespace is stripped) up to, not including, the first later line
# equal to `end`; None means the start / end of the file.  Leading and
# trailing blank lines of the excerpt are dropped.
RECIPES = [
    {
        "id": "debian-policy-binary-packages",
        "package": "debian-policy",
        "version": "4.6.2.0",
        "path": "usr/share/doc/debian-policy/policy.txt.gz",
        "render": "gzip",
        "start": "3. Binary packages",
        "end": "4. Source packages",
    },
    {
        "id": "logrotate-man",
        "package": "logrotate",
        "version": "3.21.0-1",
        "path": "usr/share/man/man8/logrotate.8.gz",
        "render": "man",
        "start": None,
        "end": None,
    },
    {
        "id": "debian-faq-support",
        "package": "debian-faq",
        "version": "11.1",
        "path": "usr/share/doc/debian/FAQ/debian-faq.en.txt.gz",
        "render": "gzip",
        "start": "Chapter\u00a012.\u00a0Getting support for Debian GNU/Linux",
        "end": "Chapter\u00a015.\u00a0Changes expected in the next major release of Debian",
    },
    {
        "id": "git-revert-faulty-merge",
        "package": "git-doc",
        "version": "1:2.39.5-0+deb12u3",
        "path": "usr/share/doc/git-doc/howto/revert-a-faulty-merge.txt",
        "render": "text",
        "start": None,
        "end": None,
    },
    {
        "id": "debian-manifesto",
        "package": "doc-debian",
        "version": "11.3+nmu1",
        "path": "usr/share/doc/debian/debian-manifesto.gz",
        "render": "gzip",
        "start": None,
        "end": None,
    },
    {
        "id": "python-sockets-howto",
        "package": "python3.11-doc",
        "version": "3.11.2-6+deb12u9",
        "path": "usr/share/doc/python3.11/html/_sources/howto/sockets.rst.txt",
        "render": "text",
        "start": None,
        "end": None,
    },
    {
        "id": "debconf-specification",
        "package": "debian-policy",
        "version": "4.6.2.0",
        "path": "usr/share/doc/debian-policy/debconf_specification.txt.gz",
        "render": "gzip",
        "start": "1.\u00a0 Introduction",
        "end": None,
    },
    {
        "id": "crontab-man",
        "package": "cron",
        "version": "3.0pl1-162",
        "path": "usr/share/man/man5/crontab.5.gz",
        "render": "man",
        "start": None,
        "end": None,
    },
    {
        "id": "debian-bug-reporting",
        "package": "doc-debian",
        "version": "11.3+nmu1",
        "path": "usr/share/doc/debian/bug-reporting.txt.gz",
        "render": "gzip",
        "start": None,
        "end": None,
    },
    {
        "id": "debian-constitution",
        "package": "doc-debian",
        "version": "11.3+nmu1",
        "path": "usr/share/doc/debian/constitution.txt.gz",
        "render": "gzip",
        "start": None,
        "end": "A. Standard Resolution Procedure",
    },
    {
        "id": "python-sorting-howto",
        "package": "python3.11-doc",
        "version": "3.11.2-6+deb12u9",
        "path": "usr/share/doc/python3.11/html/_sources/howto/sorting.rst.txt",
        "render": "text",
        "start": None,
        "end": None,
    },
    {
        "id": "maint-guide-getting-started",
        "package": "maint-guide",
        "version": "1.2.53",
        "path": "usr/share/doc/maint-guide/maint-guide.en.txt.gz",
        "render": "gzip",
        "start": "Chapter\u00a01.\u00a0Getting started The Right Way",
        "end": "Chapter\u00a02.\u00a0First steps",
    },
    {
        "id": "python-unicode-howto",
        "package": "python3.11-doc",
        "version": "3.11.2-6+deb12u9",
        "path": "usr/share/doc/python3.11/html/_sources/howto/unicode.rst.txt",
        "render": "text",
        "start": None,
        "end": "Reading and Writing Unicode Data",
    },
]


# --------------------------------------------------------------------------
# Extraction


def clean(text: str) -> str:
    """The only changes made to a package's text: form feeds and
    backspace-overstrike sequences removed, trailing whitespace stripped,
    CRLF made LF."""
    text = text.replace("\r\n", "\n").replace("\f", "")
    while "\b" in text:
        new = re.sub(r"[^\n]\x08", "", text)
        if new == text:
            text = text.replace("\b", "")
            break
        text = new
    return "\n".join(line.rstrip() for line in text.split("\n"))


def decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def render(recipe: dict, root: Path) -> str:
    path = root / recipe["path"]
    how = recipe["render"]
    if how == "text":
        return decode(path.read_bytes())
    if how == "gzip":
        return decode(gzip.decompress(path.read_bytes()))
    if how == "man":
        env = dict(os.environ, LC_ALL="C", LANG="C", MANWIDTH="80")
        env.pop("MAN_KEEP_FORMATTING", None)
        env.pop("MANPAGER", None)
        env.pop("PAGER", None)
        man = subprocess.run(
            ["man", "--nj", "--nh", "-l", str(path)],
            env=env, check=True, capture_output=True,
        )
        col = subprocess.run(
            ["col", "-bx"], input=man.stdout, env=env, check=True,
            capture_output=True,
        )
        return decode(col.stdout)
    raise ValueError(f"unknown render {how!r}")


def excerpt(text: str, start: str | None, end: str | None) -> str:
    lines = clean(text).split("\n")
    a = 0
    if start is not None:
        try:
            a = lines.index(start)
        except ValueError:
            raise ValueError(f"start marker not found: {start!r}") from None
    b = len(lines)
    if end is not None:
        try:
            b = lines.index(end, a + 1)
        except ValueError:
            raise ValueError(f"end marker not found: {end!r}") from None
    return "\n".join(lines[a:b]).strip("\n")


def download(package: str, workdir: Path) -> tuple[Path, str]:
    """apt-get download PACKAGE into workdir, unpack it; returns (root, version)."""
    pkgdir = workdir / package
    pkgdir.mkdir(parents=True, exist_ok=True)
    debs = sorted(pkgdir.glob("*.deb"))
    if not debs:
        # _apt cannot write into a root-owned temp dir: let it, to avoid a warning
        os.chmod(pkgdir, 0o777)
        got = subprocess.run(["apt-get", "download", package], cwd=pkgdir,
                             capture_output=True, text=True)
        if got.returncode != 0:
            raise RuntimeError(f"apt-get download {package} failed:\n{got.stderr}")
        debs = sorted(pkgdir.glob("*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download {package} gave no .deb")
    deb = debs[-1]
    version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True,
                             capture_output=True, text=True).stdout.strip()
    root = pkgdir / "root"
    root.mkdir(exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root, version


# --------------------------------------------------------------------------
# Checks


def load_questions(path: Path) -> list[dict]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    docs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{n}: bad JSON: {e}")
    return docs


def check_questions(docs: list[dict]) -> list[str]:
    errors: list[str] = []
    ids = collections.Counter(d.get("id") for d in docs)
    for i, n in ids.items():
        if n > 1:
            errors.append(f"duplicate document id {i!r}")
    recipe_ids = {r["id"] for r in RECIPES}
    for d in docs:
        did = d.get("id", "?")
        for field in ("id", "split", "source", "license", "document", "questions"):
            if field not in d:
                errors.append(f"{did}: missing field {field!r}")
        if d.get("split") not in SPLITS:
            errors.append(f"{did}: bad split {d.get('split')!r}")
        if did not in recipe_ids:
            errors.append(f"{did}: no extraction recipe in build.py")
        text = d.get("document", "")
        est = len(text) / CHARS_PER_TOKEN
        if not 1000 <= est <= 8000:
            errors.append(f"{did}: {len(text)} chars, ~{est:.0f} tokens, outside 1,000-8,000")
        seen_answers: dict[str, int] = {}
        for qn, q in enumerate(d.get("questions", []), 1):
            where = f"{did} q{qn}"
            for field in ("question", "answers", "evidence", "kind"):
                if field not in q:
                    errors.append(f"{where}: missing field {field!r}")
            if q.get("kind") not in KINDS:
                errors.append(f"{where}: bad kind {q.get('kind')!r}")
            answers = q.get("answers") or []
            if not answers:
                errors.append(f"{where}: no answers")
            for a in answers:
                if not a or a not in text:
                    errors.append(f"{where}: answer {a!r} not verbatim in document")
            ev = q.get("evidence", "")
            count = text.count(ev) if ev else 0
            if count != 1:
                errors.append(f"{where}: evidence occurs {count} times (must be once)")
            if answers and answers[0] not in ev:
                errors.append(f"{where}: evidence does not contain the first answer {answers[0]!r}")
            if answers:
                prev = seen_answers.get(answers[0])
                if prev is not None:
                    errors.append(f"{where}: same answer {answers[0]!r} as q{prev}")
                seen_answers[answers[0]] = qn
    return errors


def split_counts(docs: list[dict]) -> dict[str, tuple[int, int]]:
    out = {}
    for s in SPLITS:
        ds = [d for d in docs if d.get("split") == s]
        out[s] = (len(ds), sum(len(d.get("questions", [])) for d in ds))
    return out


def print_counts(docs: list[dict]) -> list[str]:
    errors = []
    print(f"{'id':34} {'split':10} {'chars':>6} {'~tokens':>7} {'questions':>9}")
    for d in docs:
        text = d.get("document", "")
        print(f"{d.get('id', '?'):34} {d.get('split', '?'):10} {len(text):6d} "
              f"{len(text) / CHARS_PER_TOKEN:7.0f} {len(d.get('questions', [])):9d}")
    counts = split_counts(docs)
    total_q = 0
    for s in SPLITS:
        nd, nq = counts[s]
        total_q += nq
        print(f"split {s:10}: {nd:2d} documents, {nq:3d} questions")
        md, mq = SPLIT_MINIMA[s]
        if nd < md or nq < mq:
            errors.append(f"split {s}: {nd} documents / {nq} questions, below {md} / {mq}")
    print(f"total: {len(docs)} documents, {total_q} questions")
    return errors


def rebuild(docs: list[dict], write_dir: Path | None, keep: Path | None) -> list[str]:
    errors: list[str] = []
    by_id = {d["id"]: d for d in docs if "id" in d}
    with tempfile.TemporaryDirectory(prefix="real-text-") as tmp:
        work = keep or Path(tmp)
        unpacked: dict[str, tuple[Path, str]] = {}
        for r in RECIPES:
            pkg = r["package"]
            if pkg not in unpacked:
                print(f"downloading {pkg} ...", flush=True)
                unpacked[pkg] = download(pkg, work)
            root, version = unpacked[pkg]
            text = excerpt(render(r, root), r["start"], r["end"])
            if write_dir is not None:
                write_dir.mkdir(parents=True, exist_ok=True)
                (write_dir / f"{r['id']}.txt").write_text(text + "\n", encoding="utf-8")
            same_version = version == r["version"]
            if not same_version:
                print(f"WARNING {r['id']}: package {pkg} is now {version}, "
                      f"the set was built from {r['version']}")
            d = by_id.get(r["id"])
            if d is None:
                msg = f"{r['id']}: recipe has no document in questions.jsonl"
                print(("" if same_version else "WARNING ") + msg)
                if same_version:
                    errors.append(msg)
                continue
            if d["document"] == text:
                print(f"ok {r['id']}: text equals the re-extraction ({len(text)} chars)")
            else:
                msg = (f"{r['id']}: committed text ({len(d['document'])} chars) differs "
                       f"from re-extraction ({len(text)} chars)")
                if same_version:
                    errors.append(msg)
                    print("MISMATCH " + msg)
                else:
                    print("WARNING " + msg + " (package version changed)")
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-only", action="store_true",
                    help="only check questions.jsonl; download nothing")
    ap.add_argument("--questions", type=Path, default=QUESTIONS)
    ap.add_argument("--write-texts", type=Path, default=None,
                    help="write each re-extracted document text to DIR/<id>.txt")
    ap.add_argument("--keep-downloads", type=Path, default=None,
                    help="download and unpack packages into DIR instead of a temp dir")
    args = ap.parse_args()

    docs = load_questions(args.questions) if args.questions.exists() else []
    if not docs and args.check_only:
        print(f"no documents in {args.questions}")
        return 1
    errors = check_questions(docs)
    errors += print_counts(docs)
    if not args.check_only:
        errors += rebuild(docs, args.write_texts, args.keep_downloads)
    for e in errors:
        print("ERROR " + e)
    if errors:
        print(f"FAILED: {len(errors)} problem(s)")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
