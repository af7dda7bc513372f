//! Reading a config as far as it goes, so that one mistake never hides
//! another: the text is parsed once into a spanned document (a syntax error
//! stops there, with its line); each top-level table and each
//! `[[pipelines]]` element is then read on its own, and a key that cannot be
//! read is reported and taken out, and the part read again, so the next
//! mistake in the same table is found too. What could be read is checked
//! (`Config::validate` and the caller's own checks) and every problem is
//! written with its line and key, in the order of the file.

use std::collections::BTreeSet;

use serde::Deserialize;
use toml::Spanned;
use toml::de::{DeArray, DeTable, DeValue};

use super::Config;
use super::locate::{
    self, Lines, Located, Path, Seg, line_of, locate, message_path, parse_path, path_at,
};

/// One problem: where, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub line: Option<usize>,
    pub text: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(l) => write!(f, "line {l}: {}", self.text),
            None => f.write_str(&self.text),
        }
    }
}

/// Keys taken out of one part before it is given up: a part with more
/// mistakes than this is reported as far as this.
const MAX_TRIES_PER_PART: usize = 32;

/// `${NAME}` in one string value replaced from `get` (`$$` is a dollar).
/// The value is replaced after the file is parsed, so whatever the variable
/// holds (quotes, backslashes, newlines, `#`) arrives byte for byte and can
/// never change the file's structure. An unset variable is a problem; its
/// reference stays as written.
pub fn interpolate_value(
    text: &str,
    get: &impl Fn(&str) -> Option<String>,
) -> (String, Vec<String>) {
    let mut out = String::with_capacity(text.len());
    let mut problems = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.push('$');
            rest = stripped;
        } else if let Some(body) = after.strip_prefix('{') {
            match body.find('}') {
                Some(end) => {
                    let name = &body[..end];
                    match get(name) {
                        Some(v) => out.push_str(&v),
                        None => {
                            problems.push(format!("environment variable `{name}` is not set"));
                            out.push_str(&rest[i..i + 2 + end + 1]);
                        }
                    }
                    rest = &body[end + 1..];
                }
                None => {
                    problems.push("unterminated `${`".to_string());
                    out.push('$');
                    rest = after;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    (out, problems)
}

/// Interpolates every string value of a parsed document (keys are names,
/// never replaced); problems come with the line of their value in `text`.
fn interpolate_doc(
    t: &mut DeTable<'_>,
    text: &Lines,
    get: &impl Fn(&str) -> Option<String>,
    problems: &mut Vec<(usize, String)>,
) {
    for (_, v) in t.iter_mut() {
        interpolate_in(v, text, get, problems);
    }
}

fn interpolate_in(
    v: &mut Spanned<DeValue<'_>>,
    text: &Lines,
    get: &impl Fn(&str) -> Option<String>,
    problems: &mut Vec<(usize, String)>,
) {
    let start = v.span().start;
    match v.get_mut() {
        DeValue::String(s) if s.contains('$') => {
            let line = text.line(start);
            let (out, found) = interpolate_value(s, get);
            problems.extend(found.into_iter().map(|p| (line, p)));
            *s = std::borrow::Cow::Owned(out);
        }
        DeValue::Array(items) => {
            for item in items.iter_mut() {
                interpolate_in(item, text, get, problems);
            }
        }
        DeValue::Table(inner) => interpolate_doc(inner, text, get, problems),
        _ => {}
    }
}

/// Reads `raw` as far as it goes. `more` adds the caller's own checks of
/// what could be read (messages that start with their key path, like
/// `validate`'s). The config comes back only when there is no problem.
pub fn read(
    raw: &str,
    env: impl Fn(&str) -> Option<String>,
    more: impl FnOnce(&Config) -> Vec<String>,
) -> Result<Config, Vec<Problem>> {
    let text = raw;
    let mut doc = match DeTable::parse(text) {
        Ok(d) => d.into_inner(),
        Err(e) => {
            return Err(vec![Problem {
                line: e.span().map(|s| line_of(text, s.start)),
                text: format!("not valid TOML: {}", e.message().trim_end()),
            }]);
        }
    };
    let lines = Lines::new(text);
    let mut unset = Vec::new();
    interpolate_doc(&mut doc, &lines, &env, &mut unset);
    let mut problems: Vec<Problem> = unset
        .iter()
        .map(|(l, m)| Problem {
            line: Some(*l),
            text: m.clone(),
        })
        .collect();
    let unset_lines: BTreeSet<usize> = unset.iter().map(|(l, _)| *l).collect();
    let reader = Reader {
        lines: &lines,
        orig: &doc,
    };
    let mut found = Vec::new();
    let cleaned = reader.read_parts(&mut found);
    match try_read(&cleaned) {
        Ok(cfg) => {
            let mut messages = cfg.validate();
            messages.extend(more(&cfg));
            found.extend(messages.iter().map(|m| reader.render(&cleaned, m)));
            if found.is_empty() && problems.is_empty() {
                return Ok(cfg);
            }
        }
        // Parts that read alone but not together (not expected: each part
        // is a whole top-level key); said as it is.
        Err(e) => found.push(reader.de_problem(&cleaned, &e)),
    }
    // What is wrong on a line with an unset variable follows from it.
    found.retain(|p| p.line.is_none_or(|l| !unset_lines.contains(&l)));
    problems.extend(found);
    // The order of the file; problems without a line (defaults) last.
    problems.sort_by_key(|p| p.line.unwrap_or(usize::MAX));
    problems.dedup();
    Err(problems)
}

fn try_read(t: &DeTable<'_>) -> Result<Config, toml::de::Error> {
    Config::deserialize(toml::de::Deserializer::from(Spanned::new(0..0, t.clone())))
}

/// The first word in backquotes after `prefix` (`missing field `x``).
fn quoted<'m>(msg: &'m str, prefix: &str) -> Option<&'m str> {
    let rest = msg.strip_prefix(prefix)?;
    rest.split('`').next()
}

/// The names in a serde "expected" list: "`a`, `b` or `c`".
fn expected_names(msg: &str) -> Vec<&str> {
    let Some((_, list)) = msg.split_once(", expected ") else {
        return Vec::new();
    };
    list.split('`').skip(1).step_by(2).collect()
}

/// Edits (insert, delete, replace) that turn `a` into `b`.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// serde's words in a technician's: keys rather than fields, a close
/// spelling suggested, number types named as numbers.
fn humanize(msg: &str) -> String {
    let msg = msg.trim_end();
    for (prefix, what) in [("unknown field `", "key"), ("unknown variant `", "value")] {
        if let Some(bad) = quoted(msg, prefix) {
            let known = expected_names(msg);
            let close = known
                .iter()
                .map(|k| (distance(bad, k), *k))
                .filter(|(d, k)| *d <= 2.max(k.len() / 4))
                .min();
            let mut s = format!("unknown {what} `{bad}`");
            if let Some((_, k)) = close {
                s.push_str(&format!(" (did you mean `{k}`?)"));
            }
            if !known.is_empty() {
                let list = known.join(", ");
                s.push_str(&match what {
                    "key" => format!("; the keys here are: {list}"),
                    _ => format!("; one of: {list}"),
                });
            }
            return s;
        }
    }
    if let Some(k) = quoted(msg, "missing field `") {
        return format!("the key `{k}` is required here");
    }
    let mut s = msg.replace("invalid type: ", "wrong type: ");
    for (rust, words) in [
        ("expected usize", "expected a whole number (0 or more)"),
        ("expected u64", "expected a whole number (0 or more)"),
        ("expected u32", "expected a whole number (0 or more)"),
        ("expected u16", "expected a whole number (0 to 65535)"),
        ("expected u8", "expected a whole number (0 to 255)"),
        ("expected i64", "expected a whole number"),
        ("expected i32", "expected a whole number"),
        ("expected f64", "expected a number"),
        ("expected f32", "expected a number"),
        ("expected a sequence", "expected a list [..]"),
        ("expected a map", "expected a table"),
    ] {
        if let Some(i) = s.find(rust) {
            // Only a whole word: `expected u8` is not `expected u80`.
            let end = i + rust.len();
            if s[end..].chars().next().is_none_or(|c| !c.is_alphanumeric()) {
                s.replace_range(i..end, words);
            }
        }
    }
    s
}

struct Reader<'a, 'i> {
    lines: &'a Lines,
    orig: &'a DeTable<'i>,
}

impl<'i> Reader<'_, 'i> {
    /// Every part read on its own; what reads, put back together.
    fn read_parts(&self, out: &mut Vec<Problem>) -> DeTable<'i> {
        let mut cleaned = DeTable::new();
        for (key, value) in self.orig.iter() {
            match value.get_ref() {
                DeValue::Array(items) if key.get_ref() == "pipelines" => {
                    let mut kept = DeArray::new();
                    for item in items.iter() {
                        let mut part = DeTable::new();
                        part.insert(
                            key.clone(),
                            Spanned::new(
                                value.span(),
                                DeValue::Array([item.clone()].into_iter().collect()),
                            ),
                        );
                        if let Some(mut good) = self.read_part(part, 2, out)
                            && let Some(v) = good.remove("pipelines")
                            && let DeValue::Array(a) = v.into_inner()
                        {
                            for e in a {
                                kept.push(e);
                            }
                        }
                    }
                    cleaned.insert(
                        key.clone(),
                        Spanned::new(value.span(), DeValue::Array(kept)),
                    );
                }
                _ => {
                    let mut part = DeTable::new();
                    part.insert(key.clone(), value.clone());
                    if let Some(good) = self.read_part(part, 1, out) {
                        cleaned.extend(good);
                    }
                }
            }
        }
        cleaned
    }

    /// Reads one part; each key that fails is reported, taken out, and the
    /// part read again. None when the part itself cannot be read (a
    /// required key missing at its top): it is left out.
    fn read_part(
        &self,
        mut part: DeTable<'i>,
        top: usize,
        out: &mut Vec<Problem>,
    ) -> Option<DeTable<'i>> {
        let mut taken_out: Vec<Path> = Vec::new();
        for _ in 0..MAX_TRIES_PER_PART {
            let err = match try_read(&part) {
                Ok(_) => return Some(part),
                Err(e) => e,
            };
            let mut path = err.span().map(|s| path_at(&part, &s)).unwrap_or_default();
            let msg = err.message().to_string();
            if let Some(k) = quoted(&msg, "missing field `") {
                let mut whole = path.clone();
                whole.push(Seg::Key(k.to_string()));
                // Missing because it was taken out: already reported.
                if !taken_out.contains(&whole) {
                    out.push(self.problem_at(&part, &path, humanize(&msg)));
                }
            } else {
                if is_table(&part, &path) {
                    // A value serde reads as a whole (a source, an output:
                    // tables tagged by `type`) fails as a whole: find the key.
                    let key = quoted(&msg, "unknown field `")
                        .filter(|k| {
                            locate::get(
                                &part,
                                &[path.clone(), vec![Seg::Key(k.to_string())]].concat(),
                            )
                            .is_some()
                        })
                        .map(str::to_string)
                        .or_else(|| blame(&part, &path, &msg));
                    if let Some(k) = key {
                        path.push(Seg::Key(k));
                    }
                }
                out.push(self.problem_at(&part, &path, humanize(&msg)));
            }
            if path.len() <= top || !locate::remove(&mut part, &path) {
                return None;
            }
            taken_out.push(path);
        }
        None
    }

    fn problem_at(&self, tree: &DeTable<'_>, path: &[Seg], what: String) -> Problem {
        let l = locate(tree, self.orig, path);
        self.problem(&l, what)
    }

    fn problem(&self, l: &Located, what: String) -> Problem {
        let line = l.at.map(|o| self.lines.line(o));
        if l.path.is_empty() {
            return Problem { line, text: what };
        }
        Problem {
            line,
            text: format!(
                "{}: {what}",
                locate::show_located(self.orig, self.lines, &l.path)
            ),
        }
    }

    fn de_problem(&self, tree: &DeTable<'_>, e: &toml::de::Error) -> Problem {
        let path = e.span().map(|s| path_at(tree, &s)).unwrap_or_default();
        self.problem_at(tree, &path, humanize(e.message()))
    }

    /// A check's message (`pipelines[1].source.url: ...`, read from
    /// `tree`) with its line, its pipeline by name and its indexes as the
    /// file counts them.
    fn render(&self, tree: &DeTable<'_>, msg: &str) -> Problem {
        let Some((mut path, len)) = message_path(msg) else {
            return Problem {
                line: None,
                text: msg.to_string(),
            };
        };
        let mut rest = &msg[len..];
        // `outbox: flush_records must ...`: the key is named after the table.
        if let Some(r) = rest.strip_prefix(": ") {
            let (sub, n) = parse_path(r);
            let whole = [path.clone(), sub].concat();
            if whole.len() > path.len()
                && r[n..].starts_with([' ', ':'])
                && locate::get(tree, &whole).is_some()
            {
                path = whole;
                rest = &r[n..];
            }
        }
        let l = locate(tree, self.orig, &path);
        let line = l.at.map(|o| self.lines.line(o));
        Problem {
            line,
            text: format!(
                "{}{}",
                locate::show_located(self.orig, self.lines, &l.path),
                self.pipelines_in(tree, rest)
            ),
        }
    }

    /// `pipelines[j]` in a message's words, written as the pipeline.
    fn pipelines_in(&self, tree: &DeTable<'_>, s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        let mut rest = s;
        while let Some(i) = rest.find("pipelines[") {
            out.push_str(&rest[..i]);
            let (path, n) = parse_path(&rest[i..]);
            match path.get(..2) {
                Some(two @ [_, Seg::Index(_)]) => {
                    let l = locate(tree, self.orig, two);
                    let Some(Seg::Index(j)) = l.path.get(1) else {
                        // Not expected (`locate` keeps the index it is
                        // given): the words stay as they were.
                        out.push_str(&rest[i..i + n]);
                        rest = &rest[i + n..];
                        continue;
                    };
                    out.push_str(&locate::show_pipeline(self.orig, self.lines, *j));
                    // `pipelines[2]` alone: anything after it stays.
                    let first = rest[i..].find(']').map_or(n, |e| e + 1);
                    rest = &rest[i + first..];
                }
                _ => {
                    out.push_str("pipelines[");
                    rest = &rest[i + "pipelines[".len()..];
                }
            }
        }
        out.push_str(rest);
        out
    }
}

fn is_table(t: &DeTable<'_>, path: &[Seg]) -> bool {
    match locate::get(t, path) {
        Some(v) => v.get_ref().is_table(),
        None => path.is_empty(),
    }
}

/// The key of the table at `path` that makes the part fail with `msg`:
/// the first whose removal changes the error. `type` picks the variant, so
/// removing it changes every error: it is tried last.
fn blame(part: &DeTable<'_>, path: &[Seg], msg: &str) -> Option<String> {
    let DeValue::Table(t) = locate::get(part, path)?.get_ref() else {
        return None;
    };
    let mut keys: Vec<(bool, usize, String)> = t
        .iter()
        .map(|(k, _)| {
            (
                k.get_ref() == "type",
                k.span().start,
                k.get_ref().to_string(),
            )
        })
        .collect();
    keys.sort();
    for (_, _, k) in keys {
        let mut trial = part.clone();
        let p = [path.to_vec(), vec![Seg::Key(k.clone())]].concat();
        if !locate::remove(&mut trial, &p) {
            continue;
        }
        match try_read(&trial) {
            Err(e) if e.message() == msg => {}
            _ => return Some(k),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(text: &str) -> Vec<String> {
        match read(text, |_| None, |_| Vec::new()) {
            Ok(_) => Vec::new(),
            Err(p) => p.iter().map(|p| p.to_string()).collect(),
        }
    }

    #[test]
    fn serde_words_become_a_technicians() {
        assert_eq!(
            humanize("unknown field `when_ful`, expected one of `name`, `when_full`, `queue`"),
            "unknown key `when_ful` (did you mean `when_full`?); the keys here are: name, when_full, queue"
        );
        assert_eq!(
            humanize("invalid type: string \"many\", expected usize"),
            "wrong type: string \"many\", expected a whole number (0 or more)"
        );
        assert_eq!(
            humanize("missing field `model`"),
            "the key `model` is required here"
        );
        assert_eq!(distance("when_ful", "when_full"), 1);
        assert_eq!(distance("", "abc"), 3);
    }

    #[test]
    fn a_wrong_type_names_its_key_and_line() {
        let p = problems(
            "[[pipelines]]\nname = \"a\"\nmodel = \"m\"\nsource = { type = \"http\" }\nqueue = \"many\"\n",
        );
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].starts_with("line 5: pipeline \"a\" (line 1), queue: wrong type"),
            "{p:?}"
        );
        // Inside a source (read by its `type`), too.
        let p = problems(
            "[[pipelines]]\nname = \"a\"\nmodel = \"m\"\nsource = { type = \"udp\",\n  listen = \"127.0.0.1:9000\",\n  recv_buffer_bytes = \"x\", framing = \"nonsense\" }\n",
        );
        assert!(!p.is_empty(), "{p:?}");
        assert!(
            p[0].starts_with("line 6: pipeline \"a\" (line 1), source."),
            "{p:?}"
        );
    }

    #[test]
    fn a_line_of_three_points_and_a_vanishing_fps_are_refused_with_their_lines() {
        let p = problems(
            "[[pipelines]]\nname = \"a\"\nmodel = \"m\"\nsource = { type = \"http\" }\n[pipelines.track]\n[[pipelines.lines]]\nname = \"gate\"\npoints = [[0, 0], [100, 0], [100, 100]]\n",
        );
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("line 8: "), "{p:?}");
        assert!(p[0].contains("exactly two points"), "{p:?}");
        let p = problems(
            "[[pipelines]]\nname = \"a\"\nmodel = \"m\"\nsource = { type = \"camera\", url = \"rtsp://h/x\",\n  fps = 1e-300 }\n",
        );
        assert!(
            p.iter().any(|p| p.contains("fps: 1e-300 is out of range")),
            "{p:?}"
        );
    }

    #[test]
    fn two_typos_in_one_table_are_both_named() {
        let p = problems(
            "[outbox]\nflush_every = \"1s\"\nmax_byte = 5\n[runtime]\nintra_threads = 0\n",
        );
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(
            p[0].starts_with("line 2: outbox.flush_every: unknown key"),
            "{p:?}"
        );
        assert!(
            p[1].starts_with(
                "line 3: outbox.max_byte: unknown key `max_byte` (did you mean `max_bytes`?)"
            ),
            "{p:?}"
        );
        assert!(
            p[2].starts_with("line 5: runtime.intra_threads: 0 is out of range"),
            "{p:?}"
        );
    }

    #[test]
    fn a_required_key_taken_out_is_reported_once() {
        let p = problems(
            "[[pipelines]]\nname = \"a\"\nmodel = 3\nsource = { type = \"http\" }\n[[pipelines]]\nname = \"b\"\nsource = { type = \"http\" }\n",
        );
        assert_eq!(p.len(), 2, "{p:?}");
        assert_eq!(
            p[0],
            "line 3: pipeline \"a\" (line 1), model: wrong type: integer `3`, expected a string"
        );
        assert_eq!(
            p[1],
            "line 5: pipeline \"b\" (line 5): the key `model` is required here"
        );
    }

    #[test]
    fn a_syntax_error_has_its_line_and_an_unset_variable_its_own() {
        let p = problems("a = 1\nb = = 2\n");
        assert_eq!(p.len(), 1);
        assert!(p[0].starts_with("line 2: not valid TOML"), "{p:?}");
        let p = problems("device = \"${NOPE}\"\n[runtime]\nintra_threads = 0\n");
        assert_eq!(p.len(), 2, "{p:?}");
        assert_eq!(p[0], "line 1: environment variable `NOPE` is not set");
        assert!(p[1].starts_with("line 3: runtime.intra_threads"), "{p:?}");
    }

    #[test]
    fn a_checks_message_is_placed_by_its_key_path() {
        let text = "[outbox]\nflush_records = 0\n[[pipelines]]\nname = \"a\"\nmodel = \"m\"\nsource = { type = \"udp\", listen = \"127.0.0.1:9000\" }\n[[pipelines]]\nname = \"a\"\nmodel = \"m\"\nsource = { type = \"udp\", listen = \"127.0.0.1:9000\" }\n";
        let p = problems(text);
        assert!(
            p.iter()
                .any(|p| p.starts_with("line 2: outbox.flush_records must")),
            "{p:?}"
        );
        assert!(
            p.iter().any(|p| p == "line 8: pipeline \"a\" (line 7), name: `a` is already the name of pipeline \"a\" (line 3)"),
            "{p:?}"
        );
        assert!(
            p.iter().any(|p| p.starts_with("line 10: pipeline \"a\" (line 7), source.listen: 127.0.0.1:9000 is also used by pipeline \"a\" (line 3)")),
            "{p:?}"
        );
    }

    /// Five mistakes in one file: each is listed, with its line and key.
    const FIVE: &str = r#"# one of each
[[pipelines]]
name = "gate"
model = "no_such_model"
when_ful = "drop_oldest"
source = { type = "camera", url = "rtsp://10.0.0.7:554/stream1", fps = 10 }

[[pipelines]]
name = "gate"
model = "sensor_mlp"
source = { type = "udp", listen = "127.0.0.1:9400" }
outputs = [{ type = "mqtt", topic = "site/{pipline}/{stream}" }]
"#;

    #[test]
    fn five_mistakes_are_five_problems_each_with_its_line_and_key() {
        // What `outpost check` adds: the model files, and the camera check
        // as a build without the `camera` feature makes it.
        let more = |cfg: &Config| {
            let mut c = cfg.clone();
            c.model_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
            let mut p = crate::cli::check::file_problems(&c);
            for (i, pl) in cfg.pipelines.iter().enumerate() {
                if let crate::source::SourceConfig::Camera(_) = pl.source {
                    p.extend(crate::source::camera::needs_camera_build(
                        &format!("pipelines[{i}].source"),
                        false,
                    ));
                }
            }
            p
        };
        let Err(p) = read(FIVE, |_| None, more) else {
            panic!("five mistakes read as a valid config");
        };
        let p: Vec<String> = p.iter().map(|p| p.to_string()).collect();
        // In a build without cameras `validate` says it too: said once.
        assert_eq!(p.len(), 5, "{p:#?}");
        let want = [
            "line 4: pipeline \"gate\" (line 2), model: model `no_such_model`: not found",
            "line 5: pipeline \"gate\" (line 2), when_ful: unknown key `when_ful` (did you mean `when_full`?)",
            "line 6: pipeline \"gate\" (line 2), source: a camera source needs outpost built with the `camera` feature",
            "line 9: pipeline \"gate\" (line 8), name: `gate` is already the name of pipeline \"gate\" (line 2)",
            "line 12: pipeline \"gate\" (line 8), outputs#1.topic: unknown placeholder `{pipline}`",
        ];
        for w in want {
            assert!(p.iter().any(|p| p.starts_with(w)), "no `{w}` in {p:#?}");
        }
    }
}
