//! `outpost modbus map --config FILE`: the register map for the
//! integrator who programs the PLC or the SCADA: each address, its kind,
//! the field it holds and the pipeline that fills it (outpost's server,
//! the modbus outputs, the modbus sources).

use anyhow::{Context, bail};

use crate::config::Config;
use crate::floor::MapRow;

#[derive(Debug, clap::Subcommand)]
pub enum ModbusCommand {
    /// Print the config's register map: role, peer, table, address, kind, field, pipeline.
    Map {
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cli: &super::Cli, cmd: &ModbusCommand) -> anyhow::Result<()> {
    match cmd {
        ModbusCommand::Map { json } => {
            if !crate::floor::MODBUS_BUILT {
                bail!("this outpost was built without the `modbus` feature");
            }
            let path = cli
                .config
                .as_ref()
                .context("--config FILE: the config whose map to print")?;
            let cfg = Config::load(path)?;
            let rows = map_rows(&cfg);
            if *json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print!("{}", crate::floor::map_text(&rows));
            }
            Ok(())
        }
    }
}

#[cfg(not(feature = "modbus"))]
fn map_rows(_cfg: &Config) -> Vec<MapRow> {
    Vec::new()
}

#[cfg(feature = "modbus")]
/// The register map of a config's Modbus parts.
fn map_rows(cfg: &Config) -> Vec<MapRow> {
    use crate::output::OutputConfig;
    use crate::source::SourceConfig;
    let mut rows = Vec::new();
    if let Some(s) = &cfg.modbus_server {
        for r in crate::floor::map_order(s) {
            rows.push(MapRow {
                role: "server",
                peer: s.listen.to_string(),
                table: if r.kind.is_bool() { "coils" } else { "holding" },
                address: r.address,
                width: r.kind.width(),
                kind: r.kind.as_str(),
                field: match &r.stream {
                    Some(st) => format!("{} (stream {st})", r.field),
                    None => r.field.clone(),
                },
                pipeline: r.pipeline.clone(),
            });
        }
    }
    for p in &cfg.pipelines {
        for o in &p.outputs {
            let OutputConfig::Modbus(o) = o else {
                continue;
            };
            let mut regs: Vec<_> = o.registers.iter().collect();
            regs.sort_by_key(|r| (r.kind.is_bool(), r.address));
            for r in regs {
                let field = match (&r.field, &r.event) {
                    (_, Some(e)) => {
                        let mut s = format!("event {e}");
                        if let Some(z) = &r.zone {
                            s.push_str(&format!(" zone {z}"));
                        }
                        if let Some(x) = &r.reset {
                            s.push_str(&format!(", reset by {x}"));
                        }
                        s
                    }
                    (Some(f), None) => f.clone(),
                    (None, None) => String::new(),
                };
                rows.push(MapRow {
                    role: "output",
                    peer: format!("{} unit {}", o.target, o.unit),
                    table: if r.kind.is_bool() { "coils" } else { "holding" },
                    address: r.address,
                    width: r.kind.width(),
                    kind: r.kind.as_str(),
                    field,
                    pipeline: p.name.clone(),
                });
            }
        }
        if let SourceConfig::Modbus(s) = &p.source {
            rows.push(MapRow {
                role: "source",
                peer: format!("{} unit {}", s.target, s.unit),
                table: s.table.as_str(),
                address: s.address,
                width: s.count,
                kind: s.kind.as_str(),
                field: format!(
                    "{} value(s) -> stream {}",
                    s.count / s.kind.width(),
                    s.stream_name()
                ),
                pipeline: p.name.clone(),
            });
        }
    }
    rows
}
