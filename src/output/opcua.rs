//! The OPC UA server (feature `opcua`) as the daemon sees it: a record tap
//! per pipeline, its status and its metrics.

use std::sync::Arc;

use prometheus_client::encoding::DescriptorEncoder;

use crate::record::ResultRecord;
use crate::telemetry::metrics::{MetricSource, counter, gauge};

use super::tap::{RecordTap, ServerStatus};

pub use outpost_opcua::{Opcua, OpcuaError, ServerCtx};

/// One pipeline's records into the server's latest-value slot.
pub struct OpcuaTap(pub outpost_opcua::Feed);

impl RecordTap for OpcuaTap {
    fn offer(&self, _rec: &ResultRecord, json: &[u8]) {
        self.0.offer(json);
    }
}

/// The running server's status and metrics.
pub struct OpcuaServer(pub Arc<Opcua>);

impl std::fmt::Debug for OpcuaServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OpcuaServer")
            .field(&self.0.local_addr())
            .finish()
    }
}

impl OpcuaServer {
    /// A tap for `pipeline` (its variables are made now).
    pub fn tap(&self, pipeline: &str) -> Arc<dyn RecordTap> {
        Arc::new(OpcuaTap(self.0.feed(pipeline)))
    }
}

impl ServerStatus for OpcuaServer {
    fn status(&self) -> serde_json::Value {
        serde_json::to_value(self.0.status()).unwrap_or(serde_json::Value::Null)
    }
}

impl MetricSource for OpcuaServer {
    fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.0.status();
        gauge(
            enc,
            "outpost_opcua_sessions",
            "OPC UA sessions open now",
            &[(Vec::new(), f64::from(s.sessions))],
        )?;
        counter(
            enc,
            "outpost_opcua_sessions_created",
            "OPC UA sessions created since the start",
            &[(Vec::new(), u64::from(s.sessions_total))],
        )?;
        counter(
            enc,
            "outpost_opcua_logins",
            "OPC UA logins accepted (a user, a certificate, or anonymous where allowed)",
            &[(Vec::new(), s.logins)],
        )?;
        let refused: Vec<_> = ["anonymous", "user", "password", "certificate"]
            .iter()
            .map(|r| {
                (
                    vec![("reason", r.to_string())],
                    s.logins_refused.get(r).copied().unwrap_or(0),
                )
            })
            .collect();
        counter(
            enc,
            "outpost_opcua_logins_refused",
            "OPC UA logins refused, by reason (anonymous not allowed, no such user, wrong password, unknown certificate)",
            &refused,
        )?;
        counter(
            enc,
            "outpost_opcua_records",
            "Records taken into the OPC UA variables",
            &[(Vec::new(), s.records)],
        )?;
        counter(
            enc,
            "outpost_opcua_records_superseded",
            "Records replaced by a newer one of their pipeline before the OPC UA server took them",
            &[(Vec::new(), s.superseded)],
        )?;
        counter(
            enc,
            "outpost_opcua_notifications",
            "OPC UA data change notifications queued to subscribed clients",
            &[(Vec::new(), s.notifications)],
        )?;
        let missing: Vec<_> = ["missing", "unfit"]
            .iter()
            .map(|r| {
                (
                    vec![("reason", r.to_string())],
                    s.values_missing.get(r).copied().unwrap_or(0),
                )
            })
            .collect();
        counter(
            enc,
            "outpost_opcua_values_missing",
            "Mapped fields a record gave no value for (missing, or not of the variable's kind)",
            &missing,
        )
    }
}
