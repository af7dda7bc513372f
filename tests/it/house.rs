//! House rules the tree keeps, checked mechanically: no function
//! signature or type alias outside tests returns `Result<_, String>`
//! (errors are typed, with what failed).

use std::path::{Path, PathBuf};

/// The source trees checked: the daemon's and every crate's.
fn source_roots() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut v = vec![root.join("src")];
    if let Ok(crates) = std::fs::read_dir(root.join("crates")) {
        let mut c: Vec<PathBuf> = crates
            .flatten()
            .map(|e| e.path().join("src"))
            .filter(|p| p.is_dir())
            .collect();
        c.sort();
        v.extend(c);
    }
    v
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs")
            && p.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(p);
        }
    }
}

/// `text` with every `#[cfg(test)]` item blanked (lines kept, so line
/// numbers still hold): a module, a function, a `use`.
fn without_tests(text: &str) -> String {
    let mut out = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim() != "#[cfg(test)]" {
            out.push(line.to_string());
            continue;
        }
        out.push(String::new());
        // The item after the attribute: to its `;` or its closing brace.
        let mut depth = 0i64;
        let mut opened = false;
        for item in lines.by_ref() {
            out.push(String::new());
            let code = item.split("//").next().unwrap_or("");
            for ch in code.chars() {
                match ch {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if (opened && depth <= 0) || (!opened && code.trim_end().ends_with(';')) {
                break;
            }
        }
    }
    out.join("\n")
}

/// Whether the generic arguments of a `Result<...>` starting at `at`
/// (just after its `<`) are two, the second `String` (`anyhow::Result<String>`
/// has one: its value).
fn errs_with_string(text: &str, at: usize) -> bool {
    let mut depth = 1i64;
    let mut last = None;
    for (i, ch) in text[at..].char_indices() {
        match ch {
            '<' | '(' | '[' => depth += 1,
            '>' | ')' | ']' => {
                depth -= 1;
                if depth == 0 {
                    let Some(last) = last else {
                        return false;
                    };
                    let arg = text[last..at + i].trim();
                    return arg == "String" || arg == "std::string::String";
                }
            }
            ',' if depth == 1 => last = Some(at + i + 1),
            _ => {}
        }
    }
    false
}

/// Each `Result<_, String>` a function signature (after `->`, in a
/// function or closure or a `Fn` type) or a type alias names: its line.
fn string_results(text: &str) -> Vec<usize> {
    let text = without_tests(text);
    let line_of = |pos: usize| text[..pos].matches('\n').count() + 1;
    let mut spans = Vec::new();
    for (pos, _) in text.match_indices("->") {
        let end = text[pos..].find(['{', ';']).map_or(text.len(), |e| pos + e);
        spans.push((pos, end));
    }
    for (pos, _) in text.match_indices("type ") {
        let start = text[..pos].rfind('\n').map_or(0, |n| n + 1);
        let head = text[start..pos].trim();
        if !(head.is_empty() || head.starts_with("pub")) {
            continue;
        }
        let end = text[pos..].find(';').map_or(text.len(), |e| pos + e);
        spans.push((pos, end));
    }
    let mut lines = Vec::new();
    for (start, end) in spans {
        for (r, _) in text[start..end].match_indices("Result<") {
            let at = start + r + "Result<".len();
            if errs_with_string(&text, at) {
                lines.push(line_of(start + r));
            }
        }
    }
    lines.sort_unstable();
    lines.dedup();
    lines
}

#[test]
fn no_signature_returns_a_string_error() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in source_roots() {
        rust_files(&dir, &mut files);
    }
    files.sort();
    assert!(files.len() > 100, "too few sources found: {}", files.len());
    let mut found = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for line in string_results(&text) {
            found.push(format!(
                "{}:{line}",
                f.strip_prefix(root).unwrap_or(f).display()
            ));
        }
    }
    assert!(
        found.is_empty(),
        "functions or type aliases returning Result<_, String> (give them a typed error):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_scanner_finds_string_results_outside_tests_only() {
    let sample = r#"
pub fn typed(x: &str) -> Result<u32, ParseError> {
    x.parse()
}
fn stringly(x: &str) -> Result<u32, String> {
    Err(x.to_string())
}
pub(crate) type Reply = Sender<Result<(), String>>;
fn nested() -> Result<Vec<(String, u8)>, std::string::String> {
    todo!()
}
fn one_arg() -> anyhow::Result<String> {
    Ok(String::new())
}
fn takes(f: &mut dyn FnMut(u64) -> Result<(), String>) -> Result<(), Error> {
    let c = || -> Result<HashMap<String, String>, Error> { Ok(HashMap::new()) };
    let s: Result<(), String> = Ok(());
    Ok(())
}
fn where_clause<T>() -> Result<T,String>
where
    T: Default,
{
    Ok(T::default())
}

#[cfg(test)]
mod tests {
    fn helper() -> Result<(), String> {
        Ok(())
    }
}

#[cfg(test)]
fn alone() -> Result<(), String> {
    Ok(())
}
"#;
    assert_eq!(string_results(sample), [5, 8, 9, 15, 20]);
}
