//! Staged rollouts, decided on the device: which offers of the manifest
//! document (or of a command) this device takes. Pure, no I/O.
//!
//! An entry may carry `rollout = {percent, salt}` and `groups = [...]`.
//! The device takes it only when both hold:
//! - `bucket(salt, device) < percent`, where `bucket` is the first 8 bytes
//!   of SHA-256(`salt` ‖ 0x00 ‖ `device`), read big-endian, mod 100. The
//!   salt names the rollout, so a device's bucket is fixed for it: raising
//!   the percent only adds devices, never swaps one wave's devices for
//!   another's; a new salt draws a new, independent order.
//! - `groups` is empty, or one of this device's `[device] groups` is listed.
//!
//! The fields only mean something when they are signed: see `document.rs`.

use sha2::{Digest, Sha256};

use super::offer::Offer;
/// The field is data of the offer (`offer.rs`); this path stays.
pub use super::offer::Rollout;

/// This device's place in the rollout named `salt`: 0..100.
pub fn bucket(salt: &str, device: &str) -> u8 {
    let mut h = Sha256::new();
    h.update(salt.as_bytes());
    h.update([0u8]);
    h.update(device.as_bytes());
    let d = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    (u64::from_be_bytes(first) % 100) as u8
}

/// Whether a device takes an entry, and why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    Selected,
    /// Outside the wave: its bucket is not under the percent.
    OutsideWave {
        bucket: u8,
        percent: u8,
    },
    /// None of the device's groups is listed.
    OtherGroups,
}

impl Selection {
    pub fn selected(&self) -> bool {
        *self == Selection::Selected
    }

    /// Why not, in words (None when selected).
    pub fn reason(&self) -> Option<String> {
        match self {
            Selection::Selected => None,
            Selection::OutsideWave { bucket, percent } => Some(format!(
                "outside the wave: bucket {bucket}, rollout at {percent} %"
            )),
            Selection::OtherGroups => Some("not in a group the entry lists".into()),
        }
    }
}

/// Whether `device` (in `groups`) takes `offer`.
pub fn select(offer: &Offer, device: &str, groups: &[String]) -> Selection {
    if !offer.groups.is_empty() && !offer.groups.iter().any(|g| groups.contains(g)) {
        return Selection::OtherGroups;
    }
    if let Some(r) = &offer.rollout {
        let b = bucket(&r.salt, device);
        if b >= r.percent {
            return Selection::OutsideWave {
                bucket: b,
                percent: r.percent,
            };
        }
    }
    Selection::Selected
}

/// Problems with an entry's targeting fields (empty: fine).
pub fn validate(offer: &Offer) -> Vec<String> {
    let mut p = Vec::new();
    if let Some(r) = &offer.rollout {
        if r.percent > 100 {
            p.push(format!("rollout.percent: {} is over 100", r.percent));
        }
        if r.salt.is_empty() {
            p.push("rollout.salt: empty (name the rollout)".into());
        }
    }
    if offer.groups.iter().any(|g| g.is_empty()) {
        p.push("groups: an empty group name".into());
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ota::bundle::BundleKind;

    fn offer(rollout: Option<Rollout>, groups: &[&str]) -> Offer {
        Offer {
            kind: BundleKind::Model,
            name: "m".into(),
            version: "1.1.0".into(),
            url: "m.tar".into(),
            sha256: "ab".repeat(32),
            size: 10,
            signature: String::new(),
            rollback: false,
            rollout,
            groups: groups.iter().map(|g| g.to_string()).collect(),
        }
    }

    fn r(percent: u8, salt: &str) -> Option<Rollout> {
        Some(Rollout {
            percent,
            salt: salt.into(),
        })
    }

    #[test]
    fn bucket_is_the_documented_hash() {
        // SHA-256("s\0gw-1"), first 8 bytes big-endian, mod 100, computed
        // here from the digest itself so the formula is what is pinned.
        let d = Sha256::digest(b"s\0gw-1");
        let want = u64::from_be_bytes(d[..8].try_into().unwrap()) % 100;
        assert_eq!(u64::from(bucket("s", "gw-1")), want);
        // The separator matters: ("ab", "c") is not ("a", "bc").
        let names: Vec<String> = (0..50).map(|i| format!("d{i}")).collect();
        assert!(
            names
                .iter()
                .any(|n| bucket("ab", n) != bucket("a", &format!("b{n}"))),
            "salt and device must not run together"
        );
    }

    #[test]
    fn waves_only_widen_and_shares_are_about_right() {
        let devices: Vec<String> = (0..2000).map(|i| format!("gw-{i:04}")).collect();
        let mut previous: Vec<&String> = Vec::new();
        for percent in [0u8, 1, 10, 50, 99, 100] {
            let o = offer(r(percent, "2026-12-sensor_mlp-1.1.0"), &[]);
            let wave: Vec<&String> = devices
                .iter()
                .filter(|d| select(&o, d, &[]).selected())
                .collect();
            for d in &previous {
                assert!(wave.contains(d), "{d} left the wave at {percent} %");
            }
            let share = wave.len() as f64 / devices.len() as f64 * 100.0;
            assert!(
                (share - f64::from(percent)).abs() < 4.0,
                "{percent} %: {share:.1} % of the devices"
            );
            previous = wave;
        }
        assert_eq!(previous.len(), devices.len(), "100 % is everyone");
        // Another salt draws another order.
        let a = offer(r(10, "one"), &[]);
        let b = offer(r(10, "two"), &[]);
        let differ = devices
            .iter()
            .filter(|d| select(&a, d, &[]).selected() != select(&b, d, &[]).selected())
            .count();
        assert!(differ > 100, "only {differ} devices differ");
    }

    #[test]
    fn groups_and_percent_both_must_hold() {
        let mine = vec!["site-a".to_string(), "pilot".to_string()];
        assert!(select(&offer(None, &[]), "gw", &mine).selected());
        assert!(select(&offer(None, &["pilot"]), "gw", &mine).selected());
        assert_eq!(
            select(&offer(None, &["site-b"]), "gw", &mine),
            Selection::OtherGroups
        );
        assert_eq!(
            select(&offer(None, &["site-b"]), "gw", &[]),
            Selection::OtherGroups
        );
        let b = bucket("s", "gw");
        assert!(select(&offer(r(b + 1, "s"), &["pilot"]), "gw", &mine).selected());
        let out = select(&offer(r(b, "s"), &["pilot"]), "gw", &mine);
        assert_eq!(
            out,
            Selection::OutsideWave {
                bucket: b,
                percent: b
            }
        );
        assert!(out.reason().unwrap().contains("outside the wave"));
        assert_eq!(
            select(&offer(r(100, "s"), &["x"]), "gw", &mine),
            Selection::OtherGroups
        );
    }

    #[test]
    fn bad_targeting_is_named() {
        assert!(validate(&offer(r(100, "s"), &["a"])).is_empty());
        let p = validate(&offer(r(101, ""), &[""]));
        assert_eq!(p.len(), 3, "{p:?}");
    }
}
