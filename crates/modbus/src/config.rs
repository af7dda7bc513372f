//! What the daemon's TOML says about Modbus: a pipeline's `modbus` output,
//! the `modbus` source, and `[modbus_server]`. Each struct refuses unknown
//! keys; `validate` returns every problem, each starting with its key
//! (prefixed with the caller's `at`), so `outpost check` can put a line on it.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::encode::{Kind, WordOrder};

/// Registers one write-multiple-registers request carries at most (FC 16).
pub const MAX_WRITE_REGISTERS: u16 = 123;
/// Coils one write-multiple-coils request carries at most (FC 15).
pub const MAX_WRITE_COILS: u16 = 1968;
/// Registers one read carries at most (FC 3, 4).
pub const MAX_READ_REGISTERS: u16 = 125;
/// Coils one read carries at most (FC 1, 2).
pub const MAX_READ_COILS: u16 = 2000;

fn default_unit() -> u8 {
    1
}
fn one() -> f64 {
    1.0
}
fn default_timeout() -> Duration {
    Duration::from_secs(1)
}

/// `type = "modbus"` in a pipeline's `outputs`: outpost is the client, the
/// PLC the server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    /// The PLC, `host:port` (e.g. "10.0.0.5:502").
    pub target: String,
    /// The unit (slave) id every request carries.
    #[serde(default = "default_unit")]
    pub unit: u8,
    /// What is written where.
    pub registers: Vec<RegisterEntry>,
    /// Register order of two-register kinds (u32, i32, f32).
    #[serde(default)]
    pub word_order: WordOrder,
    /// `record`: every record's values are written; `change`: only values
    /// that differ from what the PLC was last given.
    #[serde(default)]
    pub write: WriteMode,
    /// A request not answered within this closes the connection (it is
    /// opened again with backoff).
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

/// When an output writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WriteMode {
    #[default]
    Record,
    Change,
}

/// One entry of an output's `registers`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterEntry {
    /// A JSON pointer into the record's `outputs` (e.g. "/top/0/score").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// A coil set by this event (`zone_enter`, `line_cross`, ...) in the
    /// record's `events`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<String>,
    /// With `event`: only events of this zone (or line).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// With `event`: the event that resets the coil (e.g. `zone_leave`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset: Option<String>,
    /// Register (or coil) address, 0-based as on the wire.
    pub address: u16,
    pub kind: Kind,
    /// The register is `value * scale + offset`.
    #[serde(default = "one")]
    pub scale: f64,
    #[serde(default)]
    pub offset: f64,
}

/// `source = { type = "modbus", ... }`: polls a block of registers into one
/// sensor frame (a JSON array of the values) per `interval`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    pub target: String,
    #[serde(default = "default_unit")]
    pub unit: u8,
    /// First register (or coil), 0-based.
    pub address: u16,
    /// Registers (or coils) read; a two-register kind gives count / 2 values.
    pub count: u16,
    /// How the registers are read as values (`bool` for coils and discrete inputs).
    #[serde(default = "default_source_kind")]
    pub kind: Kind,
    /// Which table is read.
    #[serde(default)]
    pub table: Table,
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    #[serde(default)]
    pub word_order: WordOrder,
    /// Each value is `(register - offset) / scale`.
    #[serde(default = "one")]
    pub scale: f64,
    #[serde(default)]
    pub offset: f64,
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// The frames' stream name (default: the target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
}

fn default_source_kind() -> Kind {
    Kind::U16
}

/// The four tables of the Modbus data model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Table {
    /// Holding registers (FC 3).
    #[default]
    Holding,
    /// Input registers (FC 4).
    Input,
    /// Coils (FC 1).
    Coils,
    /// Discrete inputs (FC 2).
    Discrete,
}

impl Table {
    pub fn is_bits(self) -> bool {
        matches!(self, Table::Coils | Table::Discrete)
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Holding => "holding",
            Table::Input => "input",
            Table::Coils => "coils",
            Table::Discrete => "discrete",
        }
    }
}

fn default_max_connections() -> usize {
    16
}
fn default_idle_timeout() -> Duration {
    Duration::from_secs(60)
}

/// `[modbus_server]`: outpost's own Modbus TCP server, read-only, for PLCs
/// and SCADA that poll.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Client addresses let in (`10.0.0.5`, `10.0.0.0/24`; `0.0.0.0/0`
    /// lets every IPv4 client in). Everyone else is closed at once and counted.
    pub allow: Vec<String>,
    /// Connections served at once; one more is closed and counted.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// A connection that sends no request for this long is closed.
    #[serde(default = "default_idle_timeout", with = "humantime_serde")]
    pub idle_timeout: Duration,
    #[serde(default)]
    pub word_order: WordOrder,
    #[serde(default)]
    pub registers: Vec<ServerRegister>,
}

/// One `[[modbus_server.registers]]`: the latest value of a pipeline's field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerRegister {
    pub pipeline: String,
    /// A JSON pointer into the record's `outputs`.
    pub field: String,
    pub address: u16,
    pub kind: Kind,
    /// Only records of this stream (default: any stream of the pipeline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    #[serde(default = "one")]
    pub scale: f64,
    #[serde(default)]
    pub offset: f64,
}

/// `host:port` with a port above 0.
fn check_target(target: &str, at: &str, p: &mut Vec<String>) {
    match target.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() => match port.parse::<u16>() {
            Ok(0) | Err(_) => p.push(format!(
                "{at}.target: `{target}` needs a port from 1 to 65535"
            )),
            Ok(_) => {}
        },
        _ => p.push(format!(
            "{at}.target: `{target}` is not host:port (e.g. \"10.0.0.5:502\")"
        )),
    }
}

fn check_pointer(field: &str, key: &str, p: &mut Vec<String>) {
    if !field.is_empty() && !field.starts_with('/') {
        p.push(format!(
            "{key}: `{field}` is not a JSON pointer (it starts with '/', e.g. \"/top/0/score\")"
        ));
    }
}

fn check_scale(scale: f64, offset: f64, key: &str, p: &mut Vec<String>) {
    if !scale.is_finite() || scale == 0.0 {
        p.push(format!("{key}.scale: {scale} must be finite and non-zero"));
    }
    if !offset.is_finite() {
        p.push(format!("{key}.offset: {offset} must be finite"));
    }
}

/// Entries that share an address or run past the last address; each entry
/// is its key, address, kind and what it holds (a field or an event).
fn check_layout(entries: &[(String, u16, Kind, String)], p: &mut Vec<String>) {
    for (i, (key, addr, kind, _)) in entries.iter().enumerate() {
        let end = u32::from(*addr) + u32::from(kind.width());
        if end > 65_536 {
            p.push(format!(
                "{key}.address: {addr} with kind {} runs past register 65535",
                kind.as_str()
            ));
        }
        for (j, (_, oaddr, okind, what)) in entries[..i].iter().enumerate() {
            if kind.is_bool() != okind.is_bool() {
                continue;
            }
            let oend = u32::from(*oaddr) + u32::from(okind.width());
            if u32::from(*addr) < oend && u32::from(*oaddr) < end {
                let space = if kind.is_bool() { "coil" } else { "register" };
                p.push(format!(
                    "{key}.address: {space} {addr} is already taken by entry {} ({what})",
                    j + 1
                ));
            }
        }
    }
}

impl OutputConfig {
    /// Every problem, prefixed with `at` (e.g. `pipelines[0].outputs[1]`).
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        check_target(&self.target, at, &mut p);
        if self.registers.is_empty() {
            p.push(format!("{at}.registers: at least one register"));
        }
        if self.timeout.is_zero() {
            p.push(format!("{at}.timeout: must be above 0"));
        }
        let mut layout = Vec::new();
        for (i, r) in self.registers.iter().enumerate() {
            let key = format!("{at}.registers[{i}]");
            match (&r.field, &r.event) {
                (Some(_), Some(_)) => p.push(format!("{key}: give `field` or `event`, not both")),
                (None, None) => p.push(format!("{key}: `field` or `event` is required")),
                (Some(f), None) => check_pointer(f, &format!("{key}.field"), &mut p),
                (None, Some(_)) if !r.kind.is_bool() => p.push(format!(
                    "{key}.kind: an `event` entry sets a coil: kind = \"bool\""
                )),
                (None, Some(e)) if e.is_empty() => p.push(format!("{key}.event: empty")),
                _ => {}
            }
            if r.event.is_none() && (r.zone.is_some() || r.reset.is_some()) {
                p.push(format!("{key}: `zone` and `reset` go with `event`"));
            }
            check_scale(r.scale, r.offset, &key, &mut p);
            let what = match (&r.field, &r.event) {
                (_, Some(e)) => format!("event {e}"),
                (Some(f), None) => format!("field {f}"),
                (None, None) => String::new(),
            };
            layout.push((key, r.address, r.kind, what));
        }
        check_layout(&layout, &mut p);
        p
    }
}

impl SourceConfig {
    /// Every problem, prefixed with `at` (e.g. `pipelines[0].source`).
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        check_target(&self.target, at, &mut p);
        if self.interval.is_zero() {
            p.push(format!("{at}.interval: must be above 0"));
        }
        if self.timeout.is_zero() {
            p.push(format!("{at}.timeout: must be above 0"));
        }
        let max = if self.table.is_bits() {
            MAX_READ_COILS
        } else {
            MAX_READ_REGISTERS
        };
        if self.count == 0 || self.count > max {
            p.push(format!(
                "{at}.count: {} (1 to {max} for {})",
                self.count,
                self.table.as_str()
            ));
        }
        if u32::from(self.address) + u32::from(self.count) > 65_536 {
            p.push(format!(
                "{at}.count: {} from address {} runs past 65535",
                self.count, self.address
            ));
        }
        if self.table.is_bits() != self.kind.is_bool() {
            p.push(format!(
                "{at}.kind: {} with table = \"{}\" (coils and discrete inputs are kind \"bool\", registers are not)",
                self.kind.as_str(),
                self.table.as_str()
            ));
        }
        if self.kind.width() == 2 && !self.count.is_multiple_of(2) {
            p.push(format!(
                "{at}.count: {} registers do not hold a whole number of {} values (two registers each)",
                self.count,
                self.kind.as_str()
            ));
        }
        if self.stream.as_deref() == Some("") {
            p.push(format!("{at}.stream: empty"));
        }
        check_scale(self.scale, self.offset, at, &mut p);
        p
    }

    /// The frames' stream name.
    pub fn stream_name(&self) -> &str {
        self.stream.as_deref().unwrap_or(&self.target)
    }
}

impl ServerConfig {
    /// Every problem, each starting with `modbus_server`. `pipelines`: the
    /// config's pipeline names.
    pub fn validate(&self, pipelines: &[&str]) -> Vec<String> {
        let at = "modbus_server";
        let mut p = Vec::new();
        if self.allow.is_empty() {
            p.push(format!(
                "{at}.allow: list the clients let in (an address, or a network like \"10.0.0.0/24\"; \"0.0.0.0/0\" lets every IPv4 client in)"
            ));
        }
        for a in &self.allow {
            if let Err(e) = AllowList::parse_one(a) {
                p.push(format!("{at}.allow: {e}"));
            }
        }
        if self.max_connections == 0 {
            p.push(format!("{at}.max_connections: must be at least 1"));
        }
        if self.idle_timeout.is_zero() {
            p.push(format!("{at}.idle_timeout: must be above 0"));
        }
        let mut layout = Vec::new();
        for (i, r) in self.registers.iter().enumerate() {
            let key = format!("{at}.registers[{i}]");
            if !pipelines.contains(&r.pipeline.as_str()) {
                p.push(format!(
                    "{key}.pipeline: `{}` is not a pipeline of this config",
                    r.pipeline
                ));
            }
            check_pointer(&r.field, &format!("{key}.field"), &mut p);
            check_scale(r.scale, r.offset, &key, &mut p);
            let what = format!("pipeline {}, field {}", r.pipeline, r.field);
            layout.push((key, r.address, r.kind, what));
        }
        check_layout(&layout, &mut p);
        p
    }
}

/// `allow`: addresses and networks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList(Vec<(IpAddr, u8)>);

/// An `allow` entry that is neither an address nor a network.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not an address or a network (e.g. \"10.0.0.5\", \"10.0.0.0/24\")")]
pub struct BadAllow(String);

impl AllowList {
    pub fn parse(entries: &[String]) -> Result<AllowList, BadAllow> {
        entries
            .iter()
            .map(|e| Self::parse_one(e))
            .collect::<Result<_, _>>()
            .map(AllowList)
    }

    fn parse_one(e: &str) -> Result<(IpAddr, u8), BadAllow> {
        let bad = || BadAllow(e.to_string());
        let (ip, bits) = match e.split_once('/') {
            Some((ip, bits)) => (ip, Some(bits.parse::<u8>().map_err(|_| bad())?)),
            None => (e, None),
        };
        let ip: IpAddr = ip.trim().parse().map_err(|_| bad())?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        let bits = bits.unwrap_or(max);
        if bits > max {
            return Err(bad());
        }
        Ok((ip, bits))
    }

    /// Whether `peer` is let in (an IPv4 client on an IPv6 socket counts as IPv4).
    pub fn allows(&self, peer: IpAddr) -> bool {
        let peer = peer.to_canonical();
        self.0.iter().any(|(net, bits)| match (net, peer) {
            (IpAddr::V4(n), IpAddr::V4(p)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(*bits)).unwrap_or(0);
                u32::from(*n) & mask == u32::from(p) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(p)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(*bits)).unwrap_or(0);
                u128::from(*n) & mask == u128::from(p) & mask
            }
            _ => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Pl {
        outputs: Vec<OutputConfig>,
        source: SourceConfig,
    }

    #[test]
    fn the_issue_snippet_parses_and_validates() {
        let pl: Pl = toml::from_str(
            r#"
source = { target = "10.0.0.5:502", unit = 1, address = 200, count = 16, kind = "u16", interval = "200ms" }
[[outputs]]
target = "10.0.0.5:502"
unit = 1
registers = [ { field = "/top/0/index", address = 100, kind = "u16" },
              { field = "/top/0/score", address = 101, kind = "f32" } ]
"#,
        )
        .unwrap();
        let o = &pl.outputs[0];
        assert_eq!(o.word_order, WordOrder::Big);
        assert_eq!(o.write, WriteMode::Record);
        assert!(o.validate("o").is_empty(), "{:?}", o.validate("o"));
        assert!(pl.source.validate("s").is_empty());
        assert_eq!(pl.source.table, Table::Holding);
        assert_eq!(pl.source.interval, Duration::from_millis(200));
        let s: ServerConfig = toml::from_str(
            r#"
listen = "127.0.0.1:502"
allow = ["10.0.0.5"]
[[registers]]
pipeline = "line3"
field = "/top/0/index"
address = 0
kind = "u16"
"#,
        )
        .unwrap();
        assert!(s.validate(&["line3"]).is_empty());
        assert_eq!(s.validate(&["other"]).len(), 1);
    }

    #[test]
    fn overlapping_and_impossible_entries_are_refused_with_their_key() {
        let o: OutputConfig = toml::from_str(
            r#"
target = "plc"
registers = [ { field = "/a", address = 100, kind = "f32" },
              { field = "/b", address = 101, kind = "u16" },
              { field = "/c", address = 101, kind = "bool" },
              { event = "zone_enter", address = 7, kind = "u16" },
              { field = "a", address = 65535, kind = "u32", scale = 0 } ]
"#,
        )
        .unwrap();
        let p = o.validate("o");
        let has = |s: &str| p.iter().any(|x| x.contains(s));
        assert!(has("o.target"), "{p:?}");
        assert!(has(
            "o.registers[1].address: register 101 is already taken by entry 1 (field /a)"
        ));
        assert!(
            !has("o.registers[2].address"),
            "a coil and a register may share an address: {p:?}"
        );
        assert!(has("o.registers[3].kind"));
        assert!(has("o.registers[4].field"));
        assert!(has("o.registers[4].scale"));
        assert!(has("o.registers[4].address: 65535 with kind u32 runs past"));
        assert_eq!(p.len(), 6, "{p:?}");
        assert!(
            toml::from_str::<OutputConfig>("target = \"a:1\"\nregisters = []\nretries = 3\n")
                .is_err()
        );
    }

    #[test]
    fn a_source_reads_whole_values_from_a_table_that_holds_them() {
        let s = |extra: &str| -> SourceConfig {
            toml::from_str(&format!(
                "target = \"plc:502\"\naddress = 0\ninterval = \"1s\"\n{extra}"
            ))
            .unwrap()
        };
        assert!(s("count = 4\nkind = \"f32\"").validate("s").is_empty());
        assert_eq!(s("count = 3\nkind = \"f32\"").validate("s").len(), 1);
        assert_eq!(s("count = 126").validate("s").len(), 1);
        assert!(
            s("count = 2000\ntable = \"coils\"\nkind = \"bool\"")
                .validate("s")
                .is_empty()
        );
        assert_eq!(s("count = 8\ntable = \"coils\"").validate("s").len(), 1);
        assert_eq!(s("count = 8\nkind = \"bool\"").validate("s").len(), 1);
        assert_eq!(s("count = 8").stream_name(), "plc:502");
    }

    #[test]
    fn allow_lists_take_addresses_and_networks() {
        let a =
            AllowList::parse(&["10.0.0.5".into(), "192.168.1.0/24".into(), "::1".into()]).unwrap();
        assert!(a.allows("10.0.0.5".parse().unwrap()));
        assert!(!a.allows("10.0.0.6".parse().unwrap()));
        assert!(a.allows("192.168.1.77".parse().unwrap()));
        assert!(a.allows("::ffff:10.0.0.5".parse().unwrap()));
        assert!(a.allows("::1".parse().unwrap()));
        assert!(!a.allows("127.0.0.2".parse().unwrap()));
        let all = AllowList::parse(&["0.0.0.0/0".into()]).unwrap();
        assert!(all.allows("8.8.8.8".parse().unwrap()));
        assert!(AllowList::parse(&["10.0.0.0/33".into()]).is_err());
        assert!(AllowList::parse(&["plc".into()]).is_err());
    }
}
