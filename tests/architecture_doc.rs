//! docs/architecture.md stays true to the tree: every path it names exists, every file it names
//! beside a folder's row exists in that folder, and every `module::item` it names resolves to a
//! module file that defines the item. A rename that forgets the map fails here.

use std::path::{Path, PathBuf};

const ROOTS: &[&str] = &["src/", "kernels/", "tests/", "benches/", "scripts/", "docs/", "deploy/", "fuzz/", "base/"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The backticked spans of one line.
fn spans(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

/// The file that holds the Rust module `path` (`["engine", "jobs"]` → src/engine/jobs.rs), if any.
fn module_file(path: &[&str]) -> Option<PathBuf> {
    let rel = path.join("/");
    [format!("src/{rel}.rs"), format!("src/{rel}/mod.rs")].into_iter().map(|p| root().join(p)).find(|p| p.is_file())
}

/// Whether `file` (or the other files of its module folder) defines an item named `name`.
fn defines(file: &Path, name: &str) -> bool {
    let kinds = ["fn", "struct", "enum", "trait", "type", "const", "static", "mod", "macro_rules!"];
    let mut files = vec![file.to_path_buf()];
    if file.file_name().is_some_and(|f| f == "mod.rs") {
        let dir = file.parent().expect("a folder");
        files.extend(std::fs::read_dir(dir).unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "rs")));
    }
    files.iter().filter_map(|f| std::fs::read_to_string(f).ok()).any(|text| {
        kinds.iter().any(|k| {
            text.contains(&format!("{k} {name}(")) || text.contains(&format!("{k} {name} "))
                || text.contains(&format!("{k} {name}<")) || text.contains(&format!("{k} {name};"))
                || text.contains(&format!("{k} {name}:"))
        }) || text.contains(&format!("pub use {name}")) || text.contains(&format!("::{name};")) || text.contains(&format!("{name},"))
    })
}

#[test]
fn every_path_and_item_the_architecture_names_exists() {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let mut missing = Vec::new();
    for line in doc.lines() {
        let spans = spans(line);
        // A layout row: the folder its first cell names, for the bare file names beside it.
        let folder = line.starts_with("| `").then(|| spans.first().copied()).flatten().filter(|p| p.ends_with('/'));
        for span in &spans {
            for word in span.split([',', ' ']).map(str::trim).filter(|w| !w.is_empty()) {
                let word = word.trim_end_matches(['.', ':', ')']);
                if ROOTS.iter().any(|r| word.starts_with(r)) && !word.contains(['*', '<', '{']) {
                    if !root().join(word).exists() {
                        missing.push(format!("path {word}"));
                    }
                } else if let (Some(folder), true) = (folder, word.ends_with(".rs") && !word.contains('/')) {
                    if !root().join(folder).join(word).exists() && !root().join(folder).join(word.trim_end_matches(".rs")).exists() {
                        missing.push(format!("file {word} in {folder}"));
                    }
                } else if word.contains("::") && !word.contains(['(', ' ', '<']) {
                    let parts: Vec<&str> = word.split("::").collect();
                    // The longest prefix that is one of our modules; the next part must be defined there.
                    let Some(k) = (1..parts.len()).rev().find(|&k| module_file(&parts[..k]).is_some()) else { continue };
                    let file = module_file(&parts[..k]).unwrap();
                    if !defines(&file, parts[k]) {
                        missing.push(format!("item {word} ({} defines no {})", file.display(), parts[k]));
                    }
                }
            }
        }
    }
    assert!(missing.is_empty(), "docs/architecture.md names what the tree does not have:\n{}", missing.join("\n"));
}

/// Every page in docs/ is named in its index (docs/README.md), and every docs page that README.md
/// or the index links to exists.
#[test]
fn the_docs_index_names_every_page_and_every_link_to_a_page_resolves() {
    let index = std::fs::read_to_string(root().join("docs/README.md")).unwrap();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(root().join("docs")).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if name.ends_with(".md") && name != "README.md" && !index.contains(&format!("]({name})")) {
            missing.push(format!("docs/{name} is not in docs/README.md"));
        }
    }
    for (file, prefix) in [("README.md", ""), ("docs/README.md", "docs/")] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        for link in text.split("](").skip(1).filter_map(|rest| rest.split(')').next()) {
            let link = link.split('#').next().unwrap();
            if link.ends_with(".md") && !link.starts_with("http") && !root().join(prefix).join(link).exists() {
                missing.push(format!("{file} links to {link}, which does not exist"));
            }
        }
    }
    assert!(missing.is_empty(), "{missing:#?}");
}

/// Longest a source file may be before its `#[cfg(test)]` module (the whole file without one).
const MAX_LINES: usize = 800;

/// Files allowed past [`MAX_LINES`] for now, with their length then (lines before the test
/// module): one may not grow, and an entry no longer over the limit fails too (it is removed,
/// not kept as slack).
const OVER_MAX_LINES: &[(&str, usize)] = &[];

/// Lines of `text` before its test module: the first `#[cfg(test)]` whose next line that is not
/// an attribute declares a module (a `#[cfg(test)] use …` near the top does not end the count).
fn lines_before_tests(text: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    let opens_tests = |i: usize| {
        lines[i].trim() == "#[cfg(test)]"
            && lines[i + 1..].iter().map(|l| l.trim()).find(|l| !l.starts_with("#[")).is_some_and(|l| {
                ["mod ", "pub mod ", "pub(crate) mod ", "pub(super) mod "].iter().any(|p| l.starts_with(p))
            })
    };
    (0..lines.len()).find(|&i| opens_tests(i)).unwrap_or(lines.len())
}

/// Every `.rs` file below `dir`, relative to the crate root, sorted.
fn rust_files(dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path.strip_prefix(root()).unwrap().to_string_lossy().replace('\\', "/"));
        }
    }
}

/// No file under src/ is longer than [`MAX_LINES`] before its tests: a file past it is split by
/// concern (issue 73). Names every file over the limit, and every allow-list entry that is stale.
#[test]
fn no_source_file_is_longer_than_the_limit_before_its_tests() {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    files.sort();
    assert!(files.len() > 50, "src/ holds the crate ({} files found)", files.len());
    let mut problems = Vec::new();
    for file in &files {
        let n = lines_before_tests(&std::fs::read_to_string(root().join(file)).unwrap());
        match OVER_MAX_LINES.iter().find(|(f, _)| *f == file.as_str()) {
            None if n > MAX_LINES => problems.push(format!("{file}: {n} lines before its tests (the limit is {MAX_LINES}): split it by concern")),
            Some(_) if n <= MAX_LINES => problems.push(format!("{file}: {n} lines, no longer over {MAX_LINES}: remove it from OVER_MAX_LINES")),
            Some((_, was)) if n > *was => problems.push(format!("{file}: {n} lines before its tests, more than the {was} it was allowed")),
            _ => {}
        }
    }
    for (file, _) in OVER_MAX_LINES {
        if !files.iter().any(|f| f.as_str() == *file) {
            problems.push(format!("{file} is in OVER_MAX_LINES but does not exist"));
        }
    }
    assert!(problems.is_empty(), "source files over {MAX_LINES} lines before their tests:\n{}", problems.join("\n"));
}

/// The count stops at the test module, not at any `#[cfg(test)]` (an item gated to tests near the
/// top of a file does not end it).
#[test]
fn the_length_limit_counts_up_to_the_test_module() {
    assert_eq!(lines_before_tests("a\nb\n#[cfg(test)]\nmod tests {\n}\n"), 2);
    assert_eq!(lines_before_tests("use a;\n#[cfg(test)]\nuse b;\nfn f() {}\n"), 4);
    assert_eq!(lines_before_tests("a\n#[cfg(test)]\n#[allow(dead_code)]\npub(crate) mod tests;\n"), 1);
    assert_eq!(lines_before_tests("a\nb\nc"), 3);
}
