//! Sparkplug B node commands (NCMD), free of I/O: what a host asks of the node.

use prost::Message as _;

use super::proto::{Payload, Value};

/// The metric of a rebirth request (and of NBIRTH's control).
pub const REBIRTH: &str = "Node Control/Rebirth";

/// What an NCMD asks of the node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeCommand {
    /// `Node Control/Rebirth` = true.
    pub rebirth: bool,
    /// The metrics outpost does not act on, each with why.
    pub ignored: Vec<String>,
}

/// An NCMD payload that is no Sparkplug B payload at all.
#[derive(Debug, thiserror::Error)]
#[error("not a Sparkplug B payload: {0}")]
pub struct NotSparkplug(#[from] prost::DecodeError);

/// Reads an NCMD payload; Err when it is no Sparkplug B payload at all.
pub fn node_command(payload: &[u8]) -> Result<NodeCommand, NotSparkplug> {
    let p = Payload::decode(payload)?;
    let mut c = NodeCommand::default();
    for m in &p.metrics {
        match (m.name.as_deref(), &m.value) {
            (Some(REBIRTH), Some(Value::Boolean(true))) => c.rebirth = true,
            (Some(REBIRTH), Some(Value::Boolean(false))) => {
                c.ignored.push(format!("{REBIRTH} = false: nothing to do"));
            }
            (Some(REBIRTH), v) => c.ignored.push(format!(
                "{REBIRTH} with a value that is not a boolean: {v:?}"
            )),
            (Some(n), _) => c
                .ignored
                .push(format!("{n}: not a command this node takes")),
            (None, _) => c
                .ignored
                .push(format!("a metric without a name (alias {:?})", m.alias)),
        }
    }
    if p.metrics.is_empty() {
        c.ignored.push("no metrics".into());
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uplink::sparkplug::proto::{Metric, metric};

    fn ncmd(metrics: Vec<Metric>) -> Vec<u8> {
        Payload {
            timestamp: Some(1),
            metrics,
            ..Payload::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn other_and_malformed_node_commands_are_told_apart() {
        assert!(node_command(b"\xff\xff\xff").is_err());
        let c = node_command(&ncmd(vec![
            metric(REBIRTH, 1, Value::Boolean(false)),
            metric("Node Control/Reboot", 1, Value::Boolean(true)),
            metric(REBIRTH, 1, Value::Long(1)),
        ]))
        .unwrap();
        assert!(!c.rebirth);
        assert_eq!(c.ignored.len(), 3, "{:?}", c.ignored);
        assert!(c.ignored[1].starts_with("Node Control/Reboot"));
        assert_eq!(node_command(&ncmd(vec![])).unwrap().ignored, ["no metrics"]);
    }
}
