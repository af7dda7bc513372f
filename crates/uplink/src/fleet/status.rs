//! `outpost fleet status`: the devices seen on the fleet broker, from what
//! they publish there. Pure: topics and payloads in, a table out.
//!
//! Read from the default topics (`[uplink] topic` and `status_topic`):
//! - `{prefix}/{device}/status`, retained `online` / `offline` (the will):
//!   every device that ever connected, at once;
//! - `{prefix}/{device}/ota/{stream}`: OTA status events (the last step,
//!   and the version a model was installed at);
//! - `{prefix}/{device}/{pipeline}/{stream}`: result records (JSON, or a
//!   JSON array when batching): the `model` they name (`name@version`).
//!
//! Status is retained; events and records are seen only while listening.
//! Devices do not report their outbox backlog on the broker, so it is
//! shown only when a record or event carries `backlog`.

use std::collections::BTreeMap;

use serde::Serialize;

/// What is known of one device.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Device {
    pub device: String,
    /// `online`, `offline`, or None when no status was seen.
    pub status: Option<String>,
    /// Model name -> version, from records and `installed` events.
    pub models: BTreeMap<String, String>,
    /// The last OTA step seen: `step name@version`.
    pub last_ota: Option<String>,
    /// Result records seen while listening.
    pub records: u64,
    /// Outbox backlog, when reported.
    pub backlog: Option<u64>,
}

/// Devices by name.
#[derive(Debug, Clone, Default)]
pub struct Fleet {
    prefix: String,
    pub devices: BTreeMap<String, Device>,
    /// Messages that did not parse (counted, not fatal).
    pub unreadable: u64,
}

impl Fleet {
    pub fn new(prefix: &str) -> Fleet {
        Fleet {
            prefix: prefix.trim_end_matches('/').to_string(),
            ..Fleet::default()
        }
    }

    /// The subscription that sees it all.
    pub fn filter(&self) -> String {
        format!("{}/#", self.prefix)
    }

    fn device(&mut self, name: &str) -> &mut Device {
        self.devices
            .entry(name.to_string())
            .or_insert_with(|| Device {
                device: name.to_string(),
                ..Device::default()
            })
    }

    /// Takes one message from the broker.
    pub fn observe(&mut self, topic: &str, payload: &[u8]) {
        let Some(rest) = topic
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix('/'))
        else {
            return;
        };
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            [device, "status"] => {
                let s = String::from_utf8_lossy(payload).trim().to_string();
                self.device(device).status = Some(s);
            }
            [_, "cmd"] => {}
            [device, "ota", _] => match serde_json::from_slice::<serde_json::Value>(payload) {
                Ok(v) => {
                    for r in records(v) {
                        self.ota_event(device, &r);
                    }
                }
                Err(_) => self.unreadable += 1,
            },
            [device, _pipeline, _stream] => {
                match serde_json::from_slice::<serde_json::Value>(payload) {
                    Ok(v) => {
                        for r in records(v) {
                            let d = self.device(device);
                            d.records += 1;
                            if let Some((name, version)) =
                                r["model"].as_str().and_then(|m| m.split_once('@'))
                            {
                                d.models.insert(name.to_string(), version.to_string());
                            }
                            if let Some(b) = r["backlog"].as_u64() {
                                d.backlog = Some(b);
                            }
                        }
                    }
                    Err(_) => self.unreadable += 1,
                }
            }
            _ => {}
        }
    }

    fn ota_event(&mut self, device: &str, r: &serde_json::Value) {
        let e = &r["event"];
        let (Some(step), Some(name)) = (e["step"].as_str(), e["name"].as_str()) else {
            self.unreadable += 1;
            return;
        };
        let version = e["version"].as_str().unwrap_or("");
        let d = self.device(device);
        d.last_ota = Some(format!("{step} {name}@{version}"));
        if step == "installed" && name != "outpost" {
            d.models.insert(name.to_string(), version.to_string());
        }
        if let Some(b) = r["backlog"].as_u64() {
            d.backlog = Some(b);
        }
    }

    /// A plain text table, one device a line.
    pub fn table(&self) -> String {
        let rows: Vec<[String; 6]> = self
            .devices
            .values()
            .map(|d| {
                [
                    d.device.clone(),
                    d.status.clone().unwrap_or_else(|| "-".into()),
                    if d.models.is_empty() {
                        "-".into()
                    } else {
                        d.models
                            .iter()
                            .map(|(n, v)| format!("{n}@{v}"))
                            .collect::<Vec<_>>()
                            .join(",")
                    },
                    d.last_ota.clone().unwrap_or_else(|| "-".into()),
                    d.records.to_string(),
                    d.backlog.map_or_else(|| "-".into(), |b| b.to_string()),
                ]
            })
            .collect();
        let head = [
            "DEVICE", "STATUS", "MODELS", "LAST OTA", "RECORDS", "BACKLOG",
        ]
        .map(String::from);
        let mut w = head.clone().map(|h| h.len());
        for r in &rows {
            for (i, c) in r.iter().enumerate() {
                w[i] = w[i].max(c.len());
            }
        }
        let mut out = String::new();
        for r in std::iter::once(&head).chain(rows.iter()) {
            let line: Vec<String> = r
                .iter()
                .enumerate()
                .map(|(i, c)| format!("{c:<width$}", width = w[i]))
                .collect();
            out.push_str(line.join("  ").trim_end());
            out.push('\n');
        }
        out
    }
}

/// A payload's records: one, or each of a batch.
fn records(v: serde_json::Value) -> Vec<serde_json::Value> {
    match v {
        serde_json::Value::Array(a) => a,
        v => vec![v],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_versions_and_ota_steps_per_device() {
        let mut f = Fleet::new("outpost");
        assert_eq!(f.filter(), "outpost/#");
        f.observe("outpost/gw-1/status", b"online");
        f.observe("outpost/gw-2/status", b"offline");
        f.observe(
            "outpost/gw-1/sensors/s0",
            br#"[{"id":"gw-1/1/1","model":"sensor_mlp@1.0.0"},{"id":"gw-1/1/2","model":"sensor_mlp@1.0.0"}]"#,
        );
        f.observe(
            "outpost/gw-1/ota/ota",
            br#"{"id":"gw-1/1/3","pipeline":"ota","event":{"step":"installed","name":"sensor_mlp","version":"1.1.0"}}"#,
        );
        f.observe(
            "outpost/gw-2/ota/ota",
            br#"{"event":{"step":"not_selected","name":"sensor_mlp","version":"1.1.0"},"backlog":12}"#,
        );
        f.observe("outpost/gw-3/sensors/s0", b"\xff not json");
        f.observe("other/gw-9/status", b"online");
        f.observe("outpost/gw-1/cmd", b"{}");
        let g1 = &f.devices["gw-1"];
        assert_eq!(g1.status.as_deref(), Some("online"));
        assert_eq!(g1.records, 2);
        assert_eq!(g1.models["sensor_mlp"], "1.1.0");
        assert_eq!(g1.last_ota.as_deref(), Some("installed sensor_mlp@1.1.0"));
        let g2 = &f.devices["gw-2"];
        assert_eq!(g2.status.as_deref(), Some("offline"));
        assert_eq!(g2.backlog, Some(12));
        assert!(g2.models.is_empty());
        assert_eq!(f.unreadable, 1);
        assert!(!f.devices.contains_key("gw-9"));
        let t = f.table();
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("DEVICE"));
        assert!(lines[1].starts_with("gw-1") && lines[1].contains("sensor_mlp@1.1.0"));
        assert!(lines[2].contains("offline") && lines[2].contains("12"));
    }
}
