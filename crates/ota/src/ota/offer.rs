//! What the fleet offers a device: one entry of a manifest document or
//! command (a bundle, where it is, how it is signed, and who may take it).
//! Data only: the state machine (`machine.rs`) decides what to do with an
//! offer and `rollout.rs` whether this device takes it; both read this
//! file and neither reads the other.

use serde::{Deserialize, Serialize};

use super::bundle::BundleKind;

/// One entry of the fleet's manifest document: a bundle on offer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Offer {
    pub kind: BundleKind,
    pub name: String,
    pub version: String,
    /// Absolute, or relative to the manifest document's URL.
    pub url: String,
    /// sha256 of the whole bundle file, lowercase hex.
    pub sha256: String,
    pub size: u64,
    /// `ed25519:<public key, base64>:<signature, base64>` (see `sign.rs`).
    pub signature: String,
    /// The publisher asks for a downgrade; only honoured when the signed
    /// bundle says so too.
    #[serde(default)]
    pub rollback: bool,
    /// Staged rollout: only devices whose bucket is under the percent take
    /// it (see `rollout.rs`; honoured only from a signed document or command).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,
    /// Only devices in one of these `[device] groups` take it (empty: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
}

impl Offer {
    pub fn id(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }
}

/// `rollout = { percent, salt }` of a manifest entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rollout {
    /// Share of the fleet (0..=100) that takes the entry.
    pub percent: u8,
    /// Names the rollout; every wave of one rollout keeps it.
    pub salt: String,
}
