//! Where a problem is in the file: key paths (`pipelines[2].source.url`)
//! resolved to lines through the spans of the parsed document, and written
//! the way the file counts (pipelines by name, elements from 1).
//!
//! Two trees take part: the document as written (`orig`), and a copy with
//! the parts that could not be read taken out (what the config was read
//! from). Values keep the spans of the text they came from, so an element's
//! place in the file is found by its span even after earlier elements were
//! taken out of the copy.

use std::ops::Range;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// One step of a key path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seg {
    Key(String),
    Index(usize),
}

/// A key path, e.g. `pipelines[2].source.url`.
pub type Path = Vec<Seg>;

/// 1-based line of a byte offset. Counts from the start of `text`: for
/// one lookup; many lookups in one text go through a [`Lines`].
pub fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    1 + text.as_bytes()[..end]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
}

/// Where each line of a text starts, so a byte offset's line is a binary
/// search: reading a config looks up the line of every value, and counting
/// newlines from the start each time made that quadratic in the file's size
/// (48 s for a 1.33 MB file).
pub struct Lines {
    /// Offsets just past each `\n`, in order.
    newlines: Vec<usize>,
}

impl Lines {
    pub fn new(text: &str) -> Lines {
        Lines {
            newlines: text
                .bytes()
                .enumerate()
                .filter(|(_, b)| *b == b'\n')
                .map(|(i, _)| i + 1)
                .collect(),
        }
    }

    /// 1-based line of a byte offset (as [`line_of`]).
    pub fn line(&self, offset: usize) -> usize {
        1 + self.newlines.partition_point(|&start| start <= offset)
    }
}

/// Top-level keys of the config: a message starting with one of them names
/// its key; any other first word is prose.
const TOP_KEYS: [&str; 16] = [
    "device",
    "data_dir",
    "model_dir",
    "runtime",
    "scheduler",
    "outbox",
    "api",
    "site_broker",
    "embedded_broker",
    "pipelines",
    "cameras",
    "uplink",
    "opcua",
    "ota",
    "clock",
    "modbus_server",
];

fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

/// Reads a key path at the start of `s` (`a.b[2].c`); returns it and the
/// length it took. Empty when `s` starts with something else.
pub fn parse_path(s: &str) -> (Path, usize) {
    let mut path = Vec::new();
    let mut i = 0;
    let b = s.as_bytes();
    loop {
        let start = i;
        while i < b.len() && is_key_char(b[i] as char) {
            i += 1;
        }
        if i == start {
            // A path ends with a name or an index, never with a dot.
            if !path.is_empty() {
                i -= 1;
            }
            break;
        }
        path.push(Seg::Key(s[start..i].to_string()));
        while i < b.len() && b[i] == b'[' {
            let Some(close) = s[i..].find(']') else { break };
            match s[i + 1..i + close].parse::<usize>() {
                Ok(n) => path.push(Seg::Index(n)),
                Err(_) => break,
            }
            i += close + 1;
        }
        if i < b.len() && b[i] == b'.' {
            i += 1;
        } else {
            break;
        }
    }
    (path, i)
}

/// The key path a message starts with, when its first word is a config key.
pub fn message_path(msg: &str) -> Option<(Path, usize)> {
    let (path, len) = parse_path(msg);
    match path.first() {
        Some(Seg::Key(k)) if TOP_KEYS.contains(&k.as_str()) => Some((path, len)),
        _ => None,
    }
}

fn child<'a, 'i>(v: &'a Spanned<DeValue<'i>>, seg: &Seg) -> Option<ChildRef<'a, 'i>> {
    match (v.get_ref(), seg) {
        (DeValue::Table(t), Seg::Key(k)) => {
            t.get_key_value(k.as_str()).map(|(key, value)| ChildRef {
                key: Some(key.span()),
                value,
            })
        }
        (DeValue::Array(a), Seg::Index(n)) => a.get(*n).map(|value| ChildRef { key: None, value }),
        _ => None,
    }
}

struct ChildRef<'a, 'i> {
    /// The key's own span (tables only).
    key: Option<Range<usize>>,
    value: &'a Spanned<DeValue<'i>>,
}

/// Where one path lies in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The path as the file counts: indexes of the file's own elements.
    pub path: Path,
    /// The deepest step of the path that the file has: its first byte.
    pub at: Option<usize>,
    /// How many steps of `path` the file has (the rest were not written:
    /// defaults).
    pub found: usize,
}

/// Where an element or table starts: the smallest of its span and its
/// keys' (a `[[pipelines]]` table's span may be its header or its body).
fn start_of(v: &Spanned<DeValue<'_>>) -> usize {
    let mut s = v.span().start;
    if let DeValue::Table(t) = v.get_ref() {
        for (k, _) in t.iter() {
            s = s.min(k.span().start);
        }
    }
    s
}

/// Resolves `path`, read in `tree` (a copy of `orig` with parts taken out),
/// to the file: each index becomes the index of the same element in `orig`.
pub fn locate(tree: &DeTable<'_>, orig: &DeTable<'_>, path: &[Seg]) -> Located {
    let mut out = Vec::with_capacity(path.len());
    let mut at = None;
    let mut found = 0;
    // The first step is a top-level key, taken from both tables as they
    // are: a copy of either per problem made reading a config with many
    // problems quadratic in its size.
    let first = match path.first() {
        Some(Seg::Key(k)) => tree.get_key_value(k.as_str()).zip(orig.get(k.as_str())),
        _ => None,
    };
    if let Some(((key, mut t), mut o)) = first {
        at = Some(key.span().start);
        out.push(path[0].clone());
        found = 1;
        for seg in &path[1..] {
            let Some(tc) = child(t, seg) else { break };
            let file_seg = match seg {
                Seg::Key(_) => seg.clone(),
                Seg::Index(_) => {
                    // The same element in the file: the one with the same span.
                    let DeValue::Array(oa) = o.get_ref() else {
                        break;
                    };
                    let span = tc.value.span();
                    match oa.iter().position(|e| e.span() == span) {
                        Some(j) => Seg::Index(j),
                        None => break,
                    }
                }
            };
            let Some(oc) = child(o, &file_seg) else { break };
            at = Some(match tc.key {
                Some(k) => k.start,
                None => start_of(tc.value),
            });
            out.push(file_seg);
            found += 1;
            t = tc.value;
            o = oc.value;
        }
    }
    // Steps the file does not have keep their own indexes.
    out.extend(path[found..].iter().cloned());
    Located {
        path: out,
        at,
        found,
    }
}

/// The path to the deepest key or value of `table` whose span holds `span`.
pub fn path_at(table: &DeTable<'_>, span: &Range<usize>) -> Path {
    struct Search<'s> {
        span: &'s Range<usize>,
        here: Path,
        best: Path,
    }
    fn holds(outer: &Range<usize>, inner: &Range<usize>) -> bool {
        outer.start <= inner.start && inner.end <= outer.end && outer.start < outer.end
    }
    impl Search<'_> {
        fn visit(&mut self, seg: Seg, key: Option<Range<usize>>, c: &Spanned<DeValue<'_>>) {
            self.here.push(seg);
            let on_key = key.is_some_and(|k| holds(&k, self.span));
            if (on_key || holds(&c.span(), self.span)) && self.here.len() > self.best.len() {
                self.best = self.here.clone();
            }
            // A standard table's span may not cover its keys: look inside
            // every table, not only those that hold the span.
            self.walk(c.get_ref());
            self.here.pop();
        }
        fn walk(&mut self, v: &DeValue<'_>) {
            match v {
                DeValue::Table(t) => {
                    for (k, c) in t.iter() {
                        self.visit(Seg::Key(k.get_ref().to_string()), Some(k.span()), c);
                    }
                }
                DeValue::Array(a) => {
                    for (i, c) in a.iter().enumerate() {
                        self.visit(Seg::Index(i), None, c);
                    }
                }
                _ => {}
            }
        }
    }
    let mut s = Search {
        span,
        here: Vec::new(),
        best: Vec::new(),
    };
    for (k, c) in table.iter() {
        s.visit(Seg::Key(k.get_ref().to_string()), Some(k.span()), c);
    }
    s.best
}

/// The value at `path`.
pub fn get<'a, 'i>(table: &'a DeTable<'i>, path: &[Seg]) -> Option<&'a Spanned<DeValue<'i>>> {
    let (first, rest) = path.split_first()?;
    let Seg::Key(k) = first else { return None };
    let mut v = table.get(k.as_str())?;
    for seg in rest {
        v = child(v, seg)?.value;
    }
    Some(v)
}

/// Takes the key or element at `path` out; false when there is none.
pub fn remove(table: &mut DeTable<'_>, path: &[Seg]) -> bool {
    let Some((last, parent)) = path.split_last() else {
        return false;
    };
    let Some((first, rest)) = parent.split_first() else {
        return match last {
            Seg::Key(k) => table.remove(k.as_str()).is_some(),
            Seg::Index(_) => false,
        };
    };
    let Seg::Key(k) = first else { return false };
    let Some(mut v) = table.get_mut(k.as_str()) else {
        return false;
    };
    for seg in rest {
        let next = match (v.get_mut(), seg) {
            (DeValue::Table(t), Seg::Key(k)) => t.get_mut(k.as_str()),
            (DeValue::Array(a), Seg::Index(n)) => a.get_mut(*n),
            _ => None,
        };
        let Some(n) = next else { return false };
        v = n;
    }
    match (v.get_mut(), last) {
        (DeValue::Table(t), Seg::Key(k)) => t.remove(k.as_str()).is_some(),
        (DeValue::Array(a), Seg::Index(n)) if *n < a.len() => {
            let kept = a
                .iter()
                .enumerate()
                .filter(|(i, _)| i != n)
                .map(|(_, e)| e.clone())
                .collect();
            *a = kept;
            true
        }
        _ => false,
    }
}

/// `outputs[0].topic` written as the file counts: `outputs#1.topic`.
pub fn show_path(path: &[Seg]) -> String {
    let mut s = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Seg::Index(n) => s.push_str(&format!("#{}", n + 1)),
        }
    }
    s
}

/// `pipeline "gate" (line 12)`, or `[[pipelines]] #3 (line 12)` for one
/// without a readable name; `n` counts in the file.
pub fn show_pipeline(orig: &DeTable<'_>, lines: &Lines, n: usize) -> String {
    show_entry(orig, lines, "pipelines", "pipeline", n)
}

/// `camera "gate" (line 3)`, or `[[cameras]] #2 (line 3)`; `n` counts in the file.
pub fn show_camera(orig: &DeTable<'_>, lines: &Lines, n: usize) -> String {
    show_entry(orig, lines, "cameras", "camera", n)
}

/// An element of the array of tables `array` by its `name`, as a `word`.
fn show_entry(orig: &DeTable<'_>, lines: &Lines, array: &str, word: &str, n: usize) -> String {
    let path = [Seg::Key(array.into()), Seg::Index(n)];
    let Some(v) = get(orig, &path) else {
        return format!("[[{array}]] #{}", n + 1);
    };
    let line = lines.line(start_of(v));
    let name = match v.get_ref() {
        DeValue::Table(t) => t
            .get("name")
            .and_then(|n| n.get_ref().as_str())
            .map(str::to_string),
        _ => None,
    };
    match name {
        Some(name) => format!("{word} \"{name}\" (line {line})"),
        None => format!("[[{array}]] #{} (line {line})", n + 1),
    }
}

/// A located path in words: `pipeline "gate" (line 12), outputs#1.topic`.
pub fn show_located(orig: &DeTable<'_>, lines: &Lines, path: &[Seg]) -> String {
    match path {
        [Seg::Key(k), Seg::Index(n), rest @ ..] if k == "pipelines" || k == "cameras" => {
            let p = if k == "pipelines" {
                show_pipeline(orig, lines, *n)
            } else {
                show_camera(orig, lines, *n)
            };
            if rest.is_empty() {
                p
            } else {
                format!("{p}, {}", show_path(rest))
            }
        }
        _ => show_path(path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Seg {
        Seg::Key(s.into())
    }

    #[test]
    fn lines_count_from_one() {
        let t = "a = 1\nb = 2\n\nc = 3";
        assert_eq!(line_of(t, 0), 1);
        assert_eq!(line_of(t, 5), 1);
        assert_eq!(line_of(t, 6), 2);
        assert_eq!(line_of(t, t.find('c').unwrap()), 4);
        assert_eq!(line_of(t, 10_000), 4);
    }

    #[test]
    fn lines_agree_with_counting_at_every_offset() {
        for t in [
            "",
            "\n",
            "a",
            "a = 1\nb = 2\n\nc = 3",
            "x\n\n\ny\n",
            "é = \"ü\"\nz\r\nw",
        ] {
            let lines = Lines::new(t);
            for o in 0..=t.len() + 2 {
                assert_eq!(lines.line(o), line_of(t, o), "{t:?} at {o}");
            }
        }
    }

    #[test]
    fn paths_are_read_from_the_start_of_a_message() {
        let (p, n) = parse_path("pipelines[2].outputs[0].topic: bad");
        assert_eq!(
            p,
            vec![
                k("pipelines"),
                Seg::Index(2),
                k("outputs"),
                Seg::Index(0),
                k("topic")
            ]
        );
        assert_eq!(n, "pipelines[2].outputs[0].topic".len());
        let (p, n) = parse_path("uplink.host is empty");
        assert_eq!((p, n), (vec![k("uplink"), k("host")], 11));
        // A sentence's full stop is not part of the path.
        assert_eq!(parse_path("ota. x").0, vec![k("ota")]);
        assert!(message_path("a camera source needs ...").is_none());
        assert!(message_path("runtime.providers: empty").is_some());
    }

    #[test]
    fn spans_lead_to_the_line_of_the_key_and_of_the_pipeline() {
        let text = "device = \"d\"\n\n[[pipelines]]\nname = \"a\"\nmodel = \"m\"\n\n[[pipelines]]\nname = \"gate\"\noutputs = [\n  { type = \"udp\", to = \"x\" },\n  { type = \"mqtt\", topic = \"t\" },\n]\n[pipelines.source]\ntype = \"http\"\n";
        let doc = DeTable::parse(text).unwrap().into_inner();
        let path = [
            k("pipelines"),
            Seg::Index(1),
            k("outputs"),
            Seg::Index(1),
            k("topic"),
        ];
        let l = locate(&doc, &doc, &path);
        assert_eq!(l.found, 5);
        assert_eq!(line_of(text, l.at.unwrap()), 11);
        assert_eq!(
            show_located(&doc, &Lines::new(text), &l.path),
            "pipeline \"gate\" (line 7), outputs#2.topic"
        );
        let l = locate(
            &doc,
            &doc,
            &[k("pipelines"), Seg::Index(1), k("source"), k("type")],
        );
        assert_eq!(line_of(text, l.at.unwrap()), 14);
        // A key the file does not have: the line of the deepest one it has.
        let l = locate(&doc, &doc, &[k("pipelines"), Seg::Index(0), k("queue")]);
        assert_eq!((l.found, line_of(text, l.at.unwrap())), (2, 3));
        // And back: the span of a value leads to its path.
        let off = text.find("\"t\"").unwrap();
        assert_eq!(path_at(&doc, &(off..off + 3)), path.to_vec());
    }

    #[test]
    fn an_element_taken_out_keeps_the_file_count() {
        let text = "[[pipelines]]\nname = \"a\"\n[[pipelines]]\nname = \"b\"\n[[pipelines]]\nname = \"c\"\n";
        let orig = DeTable::parse(text).unwrap().into_inner();
        let mut tree = orig.clone();
        assert!(remove(&mut tree, &[k("pipelines"), Seg::Index(1)]));
        // pipelines[1] of what is left is the file's third.
        let l = locate(&tree, &orig, &[k("pipelines"), Seg::Index(1), k("name")]);
        assert_eq!(l.path[1], Seg::Index(2));
        assert_eq!(line_of(text, l.at.unwrap()), 6);
        assert_eq!(
            show_located(&orig, &Lines::new(text), &l.path),
            "pipeline \"c\" (line 5), name"
        );
        assert!(remove(
            &mut tree,
            &[k("pipelines"), Seg::Index(0), k("name")]
        ));
        assert!(!remove(
            &mut tree,
            &[k("pipelines"), Seg::Index(0), k("name")]
        ));
        assert_eq!(
            show_located(&orig, &Lines::new(text), &[k("pipelines"), Seg::Index(7)]),
            "[[pipelines]] #8"
        );
    }
}
