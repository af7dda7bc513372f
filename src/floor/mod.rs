//! The floor's controllers: PLCs and SCADA reached over Modbus TCP
//! (crates/modbus, feature `modbus`). This room holds what the rest of the
//! daemon sees of it: the config types (the same names whether the feature
//! is built or not: without it, every Modbus key is read and refused with
//! a problem saying so), the server and the sources' connections as one
//! [`Floor`] for status and metrics, and the register map the integrator
//! reads (`outpost modbus map`).
//!
//! Outputs (src/output/) and the source (src/source/modbus.rs) use the
//! crate's types through here; the daemon starts the server once (a reload
//! swaps its map, allow list and limits, not its address).

#[cfg(not(feature = "modbus"))]
mod absent;
#[cfg(feature = "modbus")]
mod modbus;

#[cfg(not(feature = "modbus"))]
pub use absent::*;
#[cfg(feature = "modbus")]
pub use modbus::*;

use std::fmt::Write as _;

/// Whether this build has the Modbus parts.
pub const MODBUS_BUILT: bool = cfg!(feature = "modbus");

/// The problem a Modbus key gets from a build without the feature.
pub fn needs_modbus_build(at: &str) -> String {
    format!(
        "{at}: Modbus needs outpost built with the `modbus` feature (a default feature; \
         this build left it out)"
    )
}

/// One row of the register map.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MapRow {
    /// `server` (outpost serves it), `output` (outpost writes it into a
    /// PLC), `source` (outpost reads it from a PLC).
    pub role: &'static str,
    /// The PLC for outputs and sources; the listen address for the server.
    pub peer: String,
    /// `holding`, `coils`, ...
    pub table: &'static str,
    pub address: u16,
    /// Registers (coils) taken.
    pub width: u16,
    pub kind: &'static str,
    /// The field (a JSON pointer into the record's outputs), or the event.
    pub field: String,
    pub pipeline: String,
}

/// One column of the map table: its heading and how a row fills it.
type Column = (&'static str, fn(&MapRow) -> String);

/// The map as a table for people.
pub fn map_text(rows: &[MapRow]) -> String {
    let mut out = String::new();
    if rows.is_empty() {
        out.push_str("no Modbus registers in this config\n");
        return out;
    }
    let w = |f: fn(&MapRow) -> String, head: &str| {
        rows.iter()
            .map(|r| f(r).len())
            .max()
            .unwrap_or(0)
            .max(head.len())
    };
    let cols: [Column; 7] = [
        ("ROLE", |r| r.role.to_string()),
        ("PEER", |r| r.peer.clone()),
        ("TABLE", |r| r.table.to_string()),
        ("ADDRESS", |r| {
            if r.width > 1 {
                format!(
                    "{}-{}",
                    r.address,
                    u32::from(r.address) + u32::from(r.width) - 1
                )
            } else {
                r.address.to_string()
            }
        }),
        ("KIND", |r| r.kind.to_string()),
        ("FIELD", |r| r.field.clone()),
        ("PIPELINE", |r| r.pipeline.clone()),
    ];
    let widths: Vec<usize> = cols.iter().map(|(h, f)| w(*f, h)).collect();
    let line = |out: &mut String, cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                let _ = write!(s, "{:<width$}  ", c, width = widths[i]);
            }
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&mut out, cols.iter().map(|(h, _)| h.to_string()).collect());
    for r in rows {
        line(&mut out, cols.iter().map(|(_, f)| f(r)).collect());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_map_is_a_table_with_ranges_for_two_register_kinds() {
        let row = |address, width, kind: &'static str| MapRow {
            role: "output",
            peer: "10.0.0.5:502 unit 1".into(),
            table: "holding",
            address,
            width,
            kind,
            field: "/top/0/score".into(),
            pipeline: "line3".into(),
        };
        let t = map_text(&[row(100, 1, "u16"), row(101, 2, "f32")]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("ROLE    PEER"), "{t}");
        assert!(lines[2].contains(" 101-102  f32 "), "{t}");
        // Columns line up: every row's KIND starts where the header's does.
        let at = lines[0].find("KIND").unwrap();
        assert!(
            lines[1..]
                .iter()
                .all(|l| &l[at..at + 3] == "u16" || &l[at..at + 3] == "f32")
        );
        assert_eq!(map_text(&[]), "no Modbus registers in this config\n");
    }
}
