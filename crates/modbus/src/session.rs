//! The client output's state, free of I/O (as rumqttc's `MqttState`): each
//! mapped register (or coil) is a slot holding the newest value a record
//! asked for, whether the PLC has it, and what is on its way. The wire side
//! asks for the next requests, performs them, and reports each outcome.
//!
//! Invariants:
//! - The queue is the slot table: one pending value per register, the
//!   newest. A PLC slower than the records never makes it grow; a value
//!   replaced before it was written is counted (`replaced`).
//! - Offering a record never waits: it only updates slots (the caller holds
//!   the lock for that long).
//! - Requests are as few as the map allows: adjacent registers go in one
//!   write-multiple-registers (up to 123), adjacent coils in one
//!   write-multiple-coils; a value is never split between two requests.
//!   Between two pending runs, registers the map holds whose value the PLC
//!   already has are written again to join them.
//! - A value the PLC refused with an exception is counted by code and not
//!   retried (the next record brings a new one; with `write = "change"` the
//!   next record writes it even if unchanged). A value lost with the
//!   connection is pending again, unless a newer one came meanwhile.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::config::{MAX_WRITE_COILS, MAX_WRITE_REGISTERS, OutputConfig, WriteMode};
use crate::encode::{Kind, WordOrder, Words, as_number, encode};

/// Where a slot's value comes from.
#[derive(Debug, Clone, PartialEq)]
enum Origin {
    Field(String),
    Event {
        event: String,
        zone: Option<String>,
        reset: Option<String>,
    },
}

#[derive(Debug, Clone)]
struct Slot {
    from: Origin,
    address: u16,
    kind: Kind,
    scale: f64,
    offset: f64,
    /// The newest value asked for, not yet taken for a request.
    want: Option<Words>,
    /// Taken for a request that has not come back.
    inflight: Option<Words>,
    /// What the PLC acknowledged last.
    sent: Option<Words>,
}

impl Slot {
    /// The value the PLC has or will have once what is queued is written.
    fn current(&self) -> Option<Words> {
        self.want.or(self.inflight).or(self.sent)
    }
}

/// Which kind of write a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    Registers,
    Coils,
}

/// One request to make: `values` from `address` on (register words, or
/// coils as 0/1). `slots` are the slots it carries (for [`Session::done`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    pub space: Space,
    pub address: u16,
    pub values: Vec<u16>,
    slots: Vec<(usize, Words)>,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// The PLC answered with this exception code.
    Exception(u8),
    /// The connection failed (or the answer did not come in time): the
    /// values go back to pending.
    Lost,
}

/// Counters of one output (read under the session's lock).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Records offered.
    pub records: u64,
    /// Values queued for writing.
    pub queued: u64,
    /// Queued values replaced by a newer one before they were written.
    pub replaced: u64,
    /// Values a record could not give, by reason (`field_missing`,
    /// `not_a_number`, `out_of_range`, `not_finite`).
    pub skipped: BTreeMap<&'static str, u64>,
    /// Requests the PLC acknowledged.
    pub requests: u64,
    /// Registers and coils written by them.
    pub written: u64,
    /// Exception answers by code.
    pub exceptions: BTreeMap<u8, u64>,
    /// Requests lost with their connection.
    pub lost: u64,
}

/// The state of one output.
#[derive(Debug)]
pub struct Session {
    /// Registers first, then coils, each by address.
    slots: Vec<Slot>,
    coils_from: usize,
    mode: WriteMode,
    order: WordOrder,
    pub stats: SessionStats,
}

impl Session {
    pub fn new(cfg: &OutputConfig) -> Session {
        let mut slots: Vec<Slot> = cfg
            .registers
            .iter()
            .map(|r| Slot {
                from: match (&r.field, &r.event) {
                    (_, Some(e)) => Origin::Event {
                        event: e.clone(),
                        zone: r.zone.clone(),
                        reset: r.reset.clone(),
                    },
                    (Some(f), None) => Origin::Field(f.clone()),
                    // validate() refuses an entry with neither.
                    (None, None) => Origin::Field(String::new()),
                },
                address: r.address,
                kind: r.kind,
                scale: r.scale,
                offset: r.offset,
                want: None,
                inflight: None,
                sent: None,
            })
            .collect();
        slots.sort_by_key(|s| (s.kind.is_bool(), s.address));
        let coils_from = slots
            .iter()
            .position(|s| s.kind.is_bool())
            .unwrap_or(slots.len());
        Session {
            slots,
            coils_from,
            mode: cfg.write,
            order: cfg.word_order,
            stats: SessionStats::default(),
        }
    }

    /// Takes one record's `outputs`; returns whether a write is now pending.
    pub fn offer(&mut self, outputs: &Value) -> bool {
        let stats = &mut self.stats;
        stats.records += 1;
        let mut pending = false;
        for s in &mut self.slots {
            let value = match &s.from {
                Origin::Field(f) => match outputs.pointer(f) {
                    None => Err("field_missing"),
                    Some(v) => as_number(v).ok_or("not_a_number"),
                },
                Origin::Event { event, zone, reset } => {
                    match event_value(outputs, event, zone.as_deref(), reset.as_deref()) {
                        Some(on) => Ok(f64::from(u8::from(on))),
                        // No such event in this record: the coil stays.
                        None => continue,
                    }
                }
            };
            let words = value.and_then(|v| {
                encode(s.kind, self.order, v, s.scale, s.offset).map_err(|e| e.reason())
            });
            let words = match words {
                Ok(w) => w,
                Err(reason) => {
                    *stats.skipped.entry(reason).or_default() += 1;
                    continue;
                }
            };
            if self.mode == WriteMode::Change && s.current() == Some(words) {
                pending |= s.want.is_some();
                continue;
            }
            if s.want.is_some() {
                stats.replaced += 1;
            }
            s.want = Some(words);
            stats.queued += 1;
            pending = true;
        }
        pending
    }

    /// Whether a value waits to be written.
    pub fn pending(&self) -> bool {
        self.slots.iter().any(|s| s.want.is_some())
    }

    /// The requests that write every pending value, each slot's value
    /// taken (in flight until [`Session::done`]).
    pub fn take(&mut self) -> Vec<Write> {
        let mut out = Vec::new();
        let (regs, coils) = (0..self.coils_from, self.coils_from..self.slots.len());
        self.runs(regs, Space::Registers, MAX_WRITE_REGISTERS, &mut out);
        self.runs(coils, Space::Coils, MAX_WRITE_COILS, &mut out);
        out
    }

    fn runs(
        &mut self,
        range: std::ops::Range<usize>,
        space: Space,
        max: u16,
        out: &mut Vec<Write>,
    ) {
        let mut i = range.start;
        while i < range.end {
            if self.slots[i].want.is_none() {
                i += 1;
                continue;
            }
            // A run from slot i: through adjacent slots that are pending or
            // whose value the PLC has, ending at the last pending one.
            let start = self.slots[i].address;
            let mut last = i;
            let mut j = i + 1;
            let mut end = u32::from(start) + u32::from(self.slots[i].kind.width());
            while j < range.end {
                let s = &self.slots[j];
                let next_end = u32::from(s.address) + u32::from(s.kind.width());
                if u32::from(s.address) != end
                    || next_end - u32::from(start) > u32::from(max)
                    || s.current().is_none()
                {
                    break;
                }
                end = next_end;
                if s.want.is_some() {
                    last = j;
                }
                j += 1;
            }
            let mut w = Write {
                space,
                address: start,
                values: Vec::new(),
                slots: Vec::new(),
            };
            for k in i..=last {
                let s = &mut self.slots[k];
                let words = match s.want.take() {
                    Some(words) => {
                        s.inflight = Some(words);
                        words
                    }
                    // Joining two runs: the value the PLC has, again.
                    None => s.current().unwrap_or_default(),
                };
                w.values.extend_from_slice(words.as_slice());
                w.slots.push((k, words));
            }
            out.push(w);
            i = last + 1;
        }
    }

    /// Reports how a request taken with [`Session::take`] ended.
    pub fn done(&mut self, w: &Write, outcome: Outcome) {
        match outcome {
            Outcome::Ok => {
                self.stats.requests += 1;
                self.stats.written += w.values.len() as u64;
            }
            Outcome::Exception(code) => *self.stats.exceptions.entry(code).or_default() += 1,
            Outcome::Lost => self.stats.lost += 1,
        }
        for (k, words) in &w.slots {
            let Some(s) = self.slots.get_mut(*k) else {
                continue;
            };
            if s.inflight == Some(*words) {
                s.inflight = None;
            }
            match outcome {
                Outcome::Ok => s.sent = Some(*words),
                // The PLC may hold anything now: write the next value whatever it is.
                Outcome::Exception(_) => s.sent = None,
                Outcome::Lost => {
                    s.sent = None;
                    if s.want.is_none() {
                        s.want = Some(*words);
                    }
                }
            }
        }
    }

    /// A new connection: the PLC may have restarted, so nothing it had is
    /// assumed (with `write = "change"` the next record writes every value).
    pub fn reconnected(&mut self) {
        for s in &mut self.slots {
            s.sent = None;
        }
    }
}

/// Whether `outputs.events` turns the coil on (`event`) or off (`reset`);
/// the last matching event of the record decides. None: no such event.
fn event_value(
    outputs: &Value,
    event: &str,
    zone: Option<&str>,
    reset: Option<&str>,
) -> Option<bool> {
    let events = outputs.get("events")?.as_array()?;
    let mut out = None;
    for e in events {
        let Some(name) = e.get("event").and_then(Value::as_str) else {
            continue;
        };
        if let Some(z) = zone {
            let at = e
                .get("zone")
                .or_else(|| e.get("line"))
                .and_then(Value::as_str);
            if at != Some(z) {
                continue;
            }
        }
        if name == event {
            out = Some(true);
        } else if reset == Some(name) {
            out = Some(false);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(text: &str) -> OutputConfig {
        toml::from_str(&format!("target = \"plc:502\"\n{text}")).unwrap()
    }

    fn issue() -> Session {
        Session::new(&cfg(
            r#"registers = [ { field = "/top/0/index", address = 100, kind = "u16" },
                          { field = "/top/0/score", address = 101, kind = "f32" } ]"#,
        ))
    }

    fn rec(index: u64, score: f64) -> Value {
        json!({"top": [{"index": index, "score": score, "label": "x"}]})
    }

    #[test]
    fn adjacent_fields_go_in_one_request() {
        let mut s = issue();
        assert!(s.offer(&rec(3, 1.0)));
        let w = s.take();
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(w[0].space, Space::Registers);
        assert_eq!(w[0].address, 100);
        assert_eq!(w[0].values, [3, 0x3F80, 0]);
        s.done(&w[0], Outcome::Ok);
        assert!(!s.pending());
        assert_eq!(s.stats.written, 3);
    }

    #[test]
    fn a_slow_plc_keeps_only_the_newest_value_of_each_register() {
        let mut s = issue();
        for i in 0..1000 {
            s.offer(&rec(i, 0.5));
        }
        let w = s.take();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].values[0], 999);
        assert_eq!(s.stats.replaced, 2 * 999);
        // More records while that request is out: one more request, newest values.
        s.offer(&rec(1000, 0.5));
        s.offer(&rec(1001, 0.5));
        s.done(&w[0], Outcome::Ok);
        let w = s.take();
        assert_eq!(w[0].values[0], 1001);
    }

    #[test]
    fn change_mode_writes_only_what_changed_and_rewrites_after_a_refusal() {
        let mut s = Session::new(&cfg(r#"write = "change"
registers = [ { field = "/a", address = 0, kind = "u16" },
              { field = "/b", address = 1, kind = "u16" },
              { field = "/c", address = 2, kind = "u16" } ]"#));
        s.offer(&json!({"a": 1, "b": 2, "c": 3}));
        let w = s.take();
        s.done(&w[0], Outcome::Ok);
        assert!(
            !s.offer(&json!({"a": 1, "b": 2, "c": 3})),
            "nothing changed"
        );
        // a and c changed, b did not: one request joins them through b.
        assert!(s.offer(&json!({"a": 5, "b": 2, "c": 6})));
        let w = s.take();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].values, [5, 2, 6]);
        s.done(&w[0], Outcome::Exception(2));
        assert_eq!(s.stats.exceptions.get(&2), Some(&1));
        assert!(!s.pending(), "a refused value is not retried by itself");
        // The same values again are written, though unchanged.
        assert!(s.offer(&json!({"a": 5, "b": 2, "c": 6})));
        assert_eq!(s.take()[0].values, [5, 2, 6]);
    }

    #[test]
    fn values_lost_with_the_connection_are_pending_again_unless_replaced() {
        let mut s = issue();
        s.offer(&rec(1, 0.0));
        let w = s.take();
        s.done(&w[0], Outcome::Lost);
        assert!(s.pending());
        assert_eq!(s.take()[0].values[0], 1);
        let mut s = issue();
        s.offer(&rec(1, 0.0));
        let w = s.take();
        s.offer(&rec(2, 0.0));
        s.done(&w[0], Outcome::Lost);
        assert_eq!(s.take()[0].values[0], 2, "the newer value wins");
    }

    #[test]
    fn gaps_in_the_map_split_requests_and_values_are_never_split() {
        let mut s = Session::new(&cfg(
            r#"registers = [ { field = "/a", address = 10, kind = "u16" },
                          { field = "/b", address = 12, kind = "u16" },
                          { field = "/c", address = 121, kind = "f32" },
                          { field = "/d", address = 123, kind = "f32" },
                          { field = "/on", address = 5, kind = "bool" },
                          { field = "/off", address = 6, kind = "bool" } ]"#,
        ));
        s.offer(&json!({"a": 1, "b": 2, "c": 1.0, "d": 2.0, "on": true, "off": 0}));
        let w = s.take();
        let shape: Vec<(Space, u16, usize)> = w
            .iter()
            .map(|w| (w.space, w.address, w.values.len()))
            .collect();
        assert_eq!(
            shape,
            [
                (Space::Registers, 10, 1),
                (Space::Registers, 12, 1),
                (Space::Registers, 121, 4),
                (Space::Coils, 5, 2),
            ]
        );
        assert_eq!(w[3].values, [1, 0]);
        // 70 f32 values in a row: 123 registers hold 61 of them, the rest the next request.
        let regs: Vec<String> = (0..70)
            .map(|i| format!("{{ field = \"/v\", address = {}, kind = \"f32\" }}", i * 2))
            .collect();
        let mut s = Session::new(&cfg(&format!("registers = [{}]", regs.join(","))));
        s.offer(&json!({"v": 1.5}));
        let w = s.take();
        assert_eq!(
            w.iter().map(|w| w.values.len()).collect::<Vec<_>>(),
            [122, 18]
        );
    }

    #[test]
    fn bad_values_are_counted_and_leave_the_register_alone() {
        let mut s = issue();
        s.offer(&json!({"top": [{"index": -1, "score": "x"}]}));
        s.offer(&json!({"top": []}));
        assert!(!s.pending());
        assert_eq!(s.stats.skipped.get("out_of_range"), Some(&1));
        assert_eq!(s.stats.skipped.get("not_a_number"), Some(&1));
        assert_eq!(s.stats.skipped.get("field_missing"), Some(&2));
    }

    #[test]
    fn zone_events_set_and_reset_a_coil() {
        let mut s = Session::new(&cfg(
            r#"registers = [ { event = "zone_enter", zone = "door", reset = "zone_leave", address = 3, kind = "bool" } ]"#,
        ));
        assert!(!s.offer(&json!({"top": []})), "no event, no write");
        assert!(!s.offer(&json!({"events": [{"event": "zone_enter", "zone": "yard"}]})));
        assert!(s.offer(&json!({"events": [{"event": "zone_enter", "zone": "door"}]})));
        let w = s.take();
        assert_eq!(
            (w[0].space, w[0].address, w[0].values.clone()),
            (Space::Coils, 3, vec![1])
        );
        s.done(&w[0], Outcome::Ok);
        assert!(s.offer(&json!({"events": [{"event": "zone_leave", "zone": "door"}]})));
        assert_eq!(s.take()[0].values, [0]);
    }
}
