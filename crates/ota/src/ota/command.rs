//! Signed update commands, received on the MQTT uplink's command topic
//! (`outpost/{device}/cmd` by default).
//!
//! A command is a JSON envelope:
//!
//! ```json
//! {"command": "{\"device\":\"gw-7\",\"issued_ms\":1764482400000,\"action\":\"update\",\"bundle\":{...}}",
//!  "signature": "ed25519:<public key>:<signature>"}
//! ```
//!
//! `command` is a JSON document carried as a string, so the bytes signed are
//! the bytes received (no canonical form to agree on). The signature is
//! ed25519 over `outpost-command-v1:` + sha256(those bytes), by a key in
//! `[ota] trusted_keys`; the context differs from the bundles', so a bundle
//! signature never passes for a command.
//!
//! The command names its device (or `*` for every device), when it was
//! issued (unix milliseconds) and optionally when it expires. A device accepts
//! only commands issued after the last one it accepted (kept in state.json),
//! so a recorded command cannot be replayed, and none issued further in the
//! future than `[ota] max_command_skew` (a command dated 2100 would
//! otherwise make every later one look like a replay). Actions:
//! - `update`: the bundle entry (as in the manifest document) is installed
//!   like an offer from a poll;
//! - `rollback`: the same, for a lower version: the signed bundle must say
//!   `rollback` too;
//! - `poll`: poll the manifest document now.

use ed25519_dalek::VerifyingKey;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::machine::Offer;
use super::sign;

/// Commands larger than this are refused unread.
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    pub command: String,
    pub signature: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Update,
    Rollback,
    Poll,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Command {
    /// The device it is for, or `*`.
    pub device: String,
    /// Unix milliseconds; must be later than the last command accepted.
    pub issued_ms: u64,
    /// Unix milliseconds after which it is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_ms: Option<u64>,
    pub action: Action,
    /// The bundle entry for `update` and `rollback`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<Offer>,
}

/// What an accepted command asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    Install(Offer),
    Poll,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CommandError {
    #[error("command of {0} bytes, over the limit")]
    TooLarge(usize),
    #[error("not a command envelope: {0}")]
    Malformed(String),
    #[error("signature: {0}")]
    Signature(String),
    #[error("for device `{0}`, not this one")]
    OtherDevice(String),
    #[error("issued at {issued}, not after the last accepted command ({last}): a replay")]
    Replay { issued: u64, last: u64 },
    #[error("expired at {0}")]
    Expired(u64),
    #[error(
        "issued at {issued}, {ahead_ms} ms ahead of this device's clock (over the allowed skew)"
    )]
    Future { issued: u64, ahead_ms: u64 },
    #[error("{0}")]
    Invalid(String),
}

impl CommandError {
    /// Refused before its signature held: anyone can send these, so they
    /// are counted and reported in aggregate, not one by one.
    pub fn is_junk(&self) -> bool {
        matches!(
            self,
            CommandError::TooLarge(_) | CommandError::Malformed(_) | CommandError::Signature(_)
        )
    }

    /// Short label for the rejection counter.
    pub fn reason(&self) -> &'static str {
        match self {
            CommandError::TooLarge(_) | CommandError::Malformed(_) => "malformed",
            CommandError::Signature(_) => "signature",
            CommandError::OtherDevice(_) => "other_device",
            CommandError::Replay { .. } => "replay",
            CommandError::Expired(_) => "expired",
            CommandError::Future { .. } => "future",
            CommandError::Invalid(_) => "invalid",
        }
    }
}

/// Signs a command (fleet side; `outpost bundle command`).
pub fn seal(key: &ed25519_dalek::SigningKey, c: &Command) -> Result<Envelope, serde_json::Error> {
    let text = serde_json::to_string(c)?;
    let digest: [u8; 32] = Sha256::digest(text.as_bytes()).into();
    Ok(Envelope {
        signature: sign::sign_digest_in(sign::COMMAND_CONTEXT, key, &digest),
        command: text,
    })
}

/// How far ahead of this device's clock a command may be dated by default.
pub const DEFAULT_MAX_SKEW_MS: u64 = 10 * 60 * 1000;

/// [`open_with_skew`] with [`DEFAULT_MAX_SKEW_MS`].
pub fn open(
    payload: &[u8],
    trusted: &[VerifyingKey],
    device: &str,
    now: u64,
    last_issued: Option<u64>,
) -> Result<(Command, Request), CommandError> {
    open_with_skew(
        payload,
        trusted,
        device,
        now,
        last_issued,
        DEFAULT_MAX_SKEW_MS,
    )
}

/// Checks a received command: size, signature, device, clock skew, replay,
/// expiry, action. No I/O; `now` and `last_issued` come from the caller.
pub fn open_with_skew(
    payload: &[u8],
    trusted: &[VerifyingKey],
    device: &str,
    now: u64,
    last_issued: Option<u64>,
    max_skew_ms: u64,
) -> Result<(Command, Request), CommandError> {
    if payload.len() > MAX_COMMAND_BYTES {
        return Err(CommandError::TooLarge(payload.len()));
    }
    let env: Envelope =
        serde_json::from_slice(payload).map_err(|e| CommandError::Malformed(e.to_string()))?;
    let digest: [u8; 32] = Sha256::digest(env.command.as_bytes()).into();
    sign::verify_digest_in(sign::COMMAND_CONTEXT, trusted, &digest, &env.signature)
        .map_err(|e| CommandError::Signature(e.to_string()))?;
    let c: Command = serde_json::from_str(&env.command)
        .map_err(|e| CommandError::Malformed(format!("signed but not a command: {e}")))?;
    if c.device != device && c.device != "*" {
        return Err(CommandError::OtherDevice(c.device));
    }
    // Before the replay check: a command from the far future must never
    // become the mark every later command is compared with.
    if c.issued_ms > now.saturating_add(max_skew_ms) {
        return Err(CommandError::Future {
            issued: c.issued_ms,
            ahead_ms: c.issued_ms - now,
        });
    }
    if let Some(last) = last_issued
        && c.issued_ms <= last
    {
        return Err(CommandError::Replay {
            issued: c.issued_ms,
            last,
        });
    }
    if let Some(exp) = c.expires_ms
        && now > exp
    {
        return Err(CommandError::Expired(exp));
    }
    let req = match (c.action, &c.bundle) {
        (Action::Poll, None) => Request::Poll,
        (Action::Poll, Some(_)) => {
            return Err(CommandError::Invalid("`poll` carries no bundle".into()));
        }
        (_, None) => {
            return Err(CommandError::Invalid(format!(
                "`{}` needs a bundle entry",
                serde_json::to_value(c.action)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default()
            )));
        }
        (Action::Update, Some(o)) => {
            if o.rollback {
                return Err(CommandError::Invalid(
                    "an `update` entry marked rollback: send `rollback`".into(),
                ));
            }
            Request::Install(o.clone())
        }
        (Action::Rollback, Some(o)) => {
            let mut o = o.clone();
            o.rollback = true;
            Request::Install(o)
        }
    };
    Ok((c, req))
}

/// Unix milliseconds now: the later of the system clock and the last known
/// good time, so a device in 1970 takes a fresh command and a clock stepped
/// back does not make an expired one valid again.
pub fn unix_ms_now() -> u64 {
    crate::clock::trusted_unix_ms()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ota::bundle::BundleKind;

    fn offer() -> Offer {
        Offer {
            kind: BundleKind::Model,
            name: "m".into(),
            version: "1.1.0".into(),
            url: "http://127.0.0.1:1/m.tar".into(),
            sha256: "ab".repeat(32),
            size: 10,
            signature: "ed25519:x:y".into(),
            rollback: false,
            rollout: None,
            groups: Vec::new(),
        }
    }

    fn cmd(action: Action, bundle: Option<Offer>) -> Command {
        Command {
            device: "gw-7".into(),
            issued_ms: 1000,
            expires_ms: Some(2000),
            action,
            bundle,
        }
    }

    fn bytes(e: &Envelope) -> Vec<u8> {
        serde_json::to_vec(e).unwrap()
    }

    #[test]
    fn a_command_from_the_far_future_is_refused_and_does_not_block_later_ones() {
        let k = crate::ota::sign::generate().unwrap();
        let trusted = [k.verifying_key()];
        let now = 1_764_482_400_000u64;
        // Issued in the year 2100, signed by a trusted key.
        let mut far = cmd(Action::Poll, None);
        far.issued_ms = 4_102_444_800_000;
        far.expires_ms = None;
        let e = seal(&k, &far).unwrap();
        let err = open_with_skew(&bytes(&e), &trusted, "gw-7", now, None, 600_000).unwrap_err();
        assert_eq!(err.reason(), "future");
        assert!(!err.is_junk(), "signed: reported one by one");
        // Within the skew: taken; a later genuine command is not a replay.
        let mut near = cmd(Action::Poll, None);
        near.issued_ms = now + 1000;
        near.expires_ms = None;
        let e = seal(&k, &near).unwrap();
        let (c, _) = open_with_skew(&bytes(&e), &trusted, "gw-7", now, None, 600_000).unwrap();
        assert_eq!(c.issued_ms, now + 1000);
    }

    #[test]
    fn junk_is_told_apart_from_signed_refusals() {
        assert!(CommandError::Malformed("x".into()).is_junk());
        assert!(CommandError::Signature("x".into()).is_junk());
        assert!(!CommandError::Replay { issued: 1, last: 2 }.is_junk());
    }

    #[test]
    fn a_signed_update_opens_and_every_check_refuses_what_it_should() {
        let k = crate::ota::sign::generate().unwrap();
        let other = crate::ota::sign::generate().unwrap();
        let trusted = [k.verifying_key()];
        let e = seal(&k, &cmd(Action::Update, Some(offer()))).unwrap();
        let (c, r) = open(&bytes(&e), &trusted, "gw-7", 1500, Some(999)).unwrap();
        assert_eq!(c.issued_ms, 1000);
        assert_eq!(r, Request::Install(offer()));
        // Replay of the same command, or an older one.
        assert_eq!(
            open(&bytes(&e), &trusted, "gw-7", 1500, Some(1000))
                .unwrap_err()
                .reason(),
            "replay"
        );
        assert_eq!(
            open(&bytes(&e), &trusted, "gw-7", 2001, None).unwrap_err(),
            CommandError::Expired(2000)
        );
        assert_eq!(
            open(&bytes(&e), &trusted, "gw-8", 1500, None).unwrap_err(),
            CommandError::OtherDevice("gw-7".into())
        );
        // Unknown key, and a tampered command.
        assert_eq!(
            open(&bytes(&e), &[other.verifying_key()], "gw-7", 1500, None)
                .unwrap_err()
                .reason(),
            "signature"
        );
        let mut t = e.clone();
        t.command = t.command.replace("1.1.0", "9.9.9");
        assert_eq!(
            open(&bytes(&t), &trusted, "gw-7", 1500, None)
                .unwrap_err()
                .reason(),
            "signature"
        );
        // A bundle's signature over the same digest is not a command's.
        let digest: [u8; 32] = Sha256::digest(e.command.as_bytes()).into();
        let mut b = e.clone();
        b.signature = sign::sign_digest(&k, &digest);
        assert_eq!(
            open(&bytes(&b), &trusted, "gw-7", 1500, None)
                .unwrap_err()
                .reason(),
            "signature"
        );
        for junk in [&b"{"[..], b"[]", b"{\"command\":1}", b""] {
            assert_eq!(
                open(junk, &trusted, "gw-7", 1500, None)
                    .unwrap_err()
                    .reason(),
                "malformed"
            );
        }
        let big = vec![b' '; MAX_COMMAND_BYTES + 1];
        assert!(matches!(
            open(&big, &trusted, "gw-7", 1500, None),
            Err(CommandError::TooLarge(_))
        ));
    }

    #[test]
    fn rollback_poll_and_fleet_wide_commands() {
        let k = crate::ota::sign::generate().unwrap();
        let trusted = [k.verifying_key()];
        let e = seal(&k, &cmd(Action::Rollback, Some(offer()))).unwrap();
        let (_, r) = open(&bytes(&e), &trusted, "gw-7", 1500, None).unwrap();
        let Request::Install(o) = r else {
            panic!("{r:?}")
        };
        assert!(o.rollback, "a rollback command marks its entry");
        let mut c = cmd(Action::Poll, None);
        c.device = "*".into();
        c.expires_ms = None;
        let e = seal(&k, &c).unwrap();
        assert_eq!(
            open(&bytes(&e), &trusted, "any", 99_999, None).unwrap().1,
            Request::Poll
        );
        for bad in [
            cmd(Action::Poll, Some(offer())),
            cmd(Action::Update, None),
            cmd(
                Action::Update,
                Some(Offer {
                    rollback: true,
                    ..offer()
                }),
            ),
        ] {
            let e = seal(&k, &bad).unwrap();
            assert_eq!(
                open(&bytes(&e), &trusted, "gw-7", 1500, None)
                    .unwrap_err()
                    .reason(),
                "invalid"
            );
        }
    }
}
