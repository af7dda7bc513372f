//! The docs against the tree: every key `outpost config example` prints is
//! documented in docs/configuration.md, no doc names a path into the tree
//! (`src/`, `crates/`, `tests/`, ...) that does not exist, and the
//! architecture page names every room. No daemon, no models, no ONNX Runtime.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use crate::common::root;

/// `outpost config example [ARGS]`; needs nothing but the binary.
fn example(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_outpost"))
        .args(["config", "example"])
        .args(args)
        .current_dir(root())
        .output()
        .expect("spawn outpost");
    assert!(out.status.success(), "config example {args:?}: {out:?}");
    String::from_utf8(out.stdout).expect("UTF-8 example")
}

/// Tables whose keys are the user's own names (HTTP header names), not config keys.
const FREE_FORM: [&str; 1] = ["headers"];

/// Every key of `table` (recursing into tables, inline tables and arrays of
/// tables) as its dotted path; tables that are not inline go into `tables`.
fn walk(
    prefix: &str,
    table: &toml::Table,
    inline: bool,
    keys: &mut BTreeSet<String>,
    tables: &mut BTreeSet<String>,
) {
    for (k, v) in table {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        let is_table = matches!(v, toml::Value::Table(_))
            || matches!(v, toml::Value::Array(a) if a.iter().any(toml::Value::is_table));
        // Tables written as `[headers]` are checked as headings, not as keys.
        if inline || !is_table {
            keys.insert(path.clone());
        }
        if FREE_FORM.contains(&k.as_str()) {
            continue;
        }
        match v {
            toml::Value::Table(t) => {
                if !inline {
                    tables.insert(format!("[{path}]"));
                }
                walk(&path, t, inline, keys, tables);
            }
            toml::Value::Array(items) => {
                for item in items {
                    if let toml::Value::Table(t) = item {
                        if !inline {
                            tables.insert(format!("[[{path}]]"));
                        }
                        walk(&path, t, true, keys, tables);
                    }
                }
            }
            _ => {}
        }
    }
}

/// The table a header line names (`[a.b]`, `[[a]]`, commented out or not).
fn header(line: &str) -> Option<String> {
    let l = line.trim_start().trim_start_matches('#').trim();
    let inner = match l.strip_prefix("[[") {
        Some(r) => r.split("]]").next()?,
        None => l.strip_prefix('[')?.split(']').next()?,
    };
    let ok = !inner.is_empty()
        && inner
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    ok.then(|| inner.to_string())
}

/// The example's keys, active ones and those commented out as
/// `# key = value` (a comment line that parses as TOML on its own), each
/// as its dotted path under the table it sits in.
fn example_keys(text: &str, keys: &mut BTreeSet<String>, tables: &mut BTreeSet<String>) {
    let parsed: toml::Table = text.parse().expect("the example is TOML");
    walk("", &parsed, false, keys, tables);
    let mut current = String::new();
    for line in text.lines() {
        if let Some(h) = header(line) {
            let brackets = if line.contains("[[") {
                ("[[", "]]")
            } else {
                ("[", "]")
            };
            tables.insert(format!("{}{h}{}", brackets.0, brackets.1));
            current = h;
            continue;
        }
        let Some(rest) = line.trim_start().strip_prefix('#') else {
            continue;
        };
        if let Ok(t) = rest.trim().parse::<toml::Table>() {
            walk(&current, &t, true, keys, tables);
        }
    }
}

#[test]
fn every_example_key_is_documented() {
    let mut keys = BTreeSet::new();
    let mut tables = BTreeSet::new();
    example_keys(&example(&[]), &mut keys, &mut tables);
    example_keys(&example(&["--uplink", "http"]), &mut keys, &mut tables);
    assert!(keys.len() > 80, "too few keys parsed: {keys:?}");
    assert!(
        keys.contains("runtime.onnxruntime"),
        "commented keys: {keys:?}"
    );

    let doc = std::fs::read_to_string(root().join("docs/configuration.md"))
        .expect("docs/configuration.md");
    let headings: Vec<&str> = doc.lines().filter(|l| l.starts_with('#')).collect();
    let mut missing = Vec::new();
    for path in &keys {
        let name = path.rsplit('.').next().unwrap_or(path);
        if !doc.contains(&format!("`{name}`")) && !doc.contains(&format!("`{path}`")) {
            missing.push(format!("key `{path}`"));
        }
    }
    for t in &tables {
        if !headings.iter().any(|h| h.contains(t.as_str())) {
            missing.push(format!("no heading names `{t}`"));
        }
    }
    assert!(
        missing.is_empty(),
        "docs/configuration.md lacks {} item(s) that `outpost config example` prints \
         (document each key as `key` in its table's section):\n  {}",
        missing.len(),
        missing.join("\n  ")
    );
}

/// The folders of the checkout a doc may name paths in.
const TREE: [&str; 11] = [
    "src/",
    "crates/",
    "tests/",
    "perf/",
    "scripts/",
    "cross/",
    "systemd/",
    "benches/",
    "examples/",
    "targets/",
    "dashboards/",
];

/// Paths into the tree (`src/...`, `crates/...`, `tests/...`) named in
/// `text`, trailing punctuation removed.
fn src_paths(text: &str) -> Vec<String> {
    let path_char = |c: char| c.is_ascii_alphanumeric() || "_/.-".contains(c);
    let mut found = Vec::new();
    for top in TREE {
        let mut from = 0;
        while let Some(i) = text[from..].find(top) {
            let at = from + i;
            from = at + top.len();
            if text[..at].chars().next_back().is_some_and(path_char) {
                continue; // part of a longer path (`tests/src/`, `rsrc/`)
            }
            let end = text[at..]
                .find(|c: char| !path_char(c))
                .map_or(text.len(), |n| at + n);
            let p = text[at..end].trim_end_matches(['.', '-']);
            if p.len() > top.len() {
                found.push(p.to_string());
            }
        }
    }
    found
}

#[test]
fn docs_name_only_src_paths_that_exist() {
    let mut files: Vec<PathBuf> = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs")).expect("docs/") {
        let p = e.expect("dir entry").path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    assert!(files.len() > 5, "{files:?}");
    let mut gone = Vec::new();
    let mut seen = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read doc");
        for p in src_paths(&text) {
            seen += 1;
            if !root().join(&p).exists() {
                let name = f.strip_prefix(root()).unwrap_or(f).display().to_string();
                gone.push(format!("{name}: {p}"));
            }
        }
    }
    assert!(seen > 10, "too few paths found ({seen})");
    assert!(
        gone.is_empty(),
        "docs name paths that do not exist:\n  {}",
        gone.join("\n  ")
    );
}

#[test]
fn src_paths_are_found_whole() {
    assert_eq!(
        src_paths("see `src/cli/config.rs`, src/api/. and vendor/src/x.rs"),
        ["src/cli/config.rs", "src/api/"]
    );
    assert_eq!(
        src_paths("crates/track/src/track/ and `tests/it/docs.rs`; /var/lib/outpost/tests/x"),
        ["crates/track/src/track/", "tests/it/docs.rs"]
    );
}

/// Every room is on the architecture page: each crate of the workspace, each
/// top-level module of a crate (a folder or a file beside `lib.rs`), named
/// by its path.
#[test]
fn the_architecture_page_names_every_room() {
    let page = std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).expect("page");
    let mut rooms = Vec::new();
    let mut srcs = vec!["src".to_string()];
    for e in std::fs::read_dir(root().join("crates")).expect("crates/") {
        let name = e
            .expect("dir entry")
            .file_name()
            .to_string_lossy()
            .to_string();
        srcs.push(format!("crates/{name}/src"));
        rooms.push(format!("crates/{name}/"));
    }
    for s in &srcs {
        for e in std::fs::read_dir(root().join(s)).expect("src") {
            let p = e.expect("dir entry").path();
            let name = p
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            if p.is_dir() {
                rooms.push(format!("{s}/{name}/"));
            } else if !["lib.rs", "main.rs"].contains(&name.as_str()) && name.ends_with(".rs") {
                rooms.push(format!("{s}/{name}"));
            }
        }
    }
    assert!(rooms.len() > 20, "{rooms:?}");
    let missing: Vec<&String> = rooms
        .iter()
        .filter(|r| !page.contains(r.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/ARCHITECTURE.md does not name these rooms: {missing:?}"
    );
}
