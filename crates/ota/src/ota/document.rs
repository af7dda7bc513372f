//! The manifest document a device polls: plain, or signed as a whole.
//! Pure, no I/O.
//!
//! Plain (each bundle signed, the list not):
//!
//! ```json
//! {"bundles": [{…entry…}]}
//! ```
//!
//! Signed (what staged rollouts need):
//!
//! ```json
//! {"document": "{\"issued_ms\":1764482400000,\"bundles\":[…]}",
//!  "signature": "ed25519:<public key>:<signature>"}
//! ```
//!
//! As with commands, `document` is JSON carried as a string, so the bytes
//! signed are the bytes received; the signature is ed25519 over
//! `outpost-manifest-v1:` + SHA-256 of those bytes by a trusted key (its
//! own context: a bundle or command signature never passes for it).
//!
//! Invariants:
//! - An entry's `rollout` and `groups` are honoured only from a signed
//!   document (or a signed command): in a plain document such an entry is
//!   skipped, so an edit of the list cannot widen a wave.
//! - Once a device has accepted a signed document it refuses plain ones
//!   (kept in state.json), and so does a device with
//!   `[ota] require_signed_manifest`: stripping the rollout fields and the
//!   signature does not talk a device into the update either.
//! - A signed document issued before the last one accepted is a replay and
//!   refused: an old wave (or the update a rollback replaced) cannot be
//!   served again.
//! - A signed document dated further ahead of the device's clock than
//!   `max_skew_ms` (`[ota] max_command_skew`, the bound commands have) is
//!   refused and never raises the replay floor: a document dated 2100 would
//!   otherwise make every current one after it look like a replay.

use ed25519_dalek::{SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::machine::Offer;
use super::{rollout, sign};

/// What a manifest document is signed under.
pub const MANIFEST_CONTEXT: &[u8] = b"outpost-manifest-v1:";

/// Documents larger than this are refused unread.
pub const MAX_DOCUMENT_BYTES: usize = 4 << 20;

/// The plain document.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Document {
    #[serde(default)]
    pub bundles: Vec<Offer>,
}

/// The signed document's envelope.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    pub document: String,
    pub signature: String,
}

/// What a signed document says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedDocument {
    /// Unix milliseconds; never lower than the last accepted document's.
    pub issued_ms: u64,
    #[serde(default)]
    pub bundles: Vec<Offer>,
}

/// How a device takes documents.
#[derive(Debug, Clone)]
pub struct Policy {
    pub trusted: Vec<VerifyingKey>,
    /// Refuse plain documents (`[ota] require_signed_manifest`).
    pub require_signed: bool,
    /// `issued_ms` of the last signed document accepted.
    pub last_signed: Option<u64>,
    /// How far ahead of the device's clock a signed document may be dated.
    pub max_skew_ms: u64,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            trusted: Vec::new(),
            require_signed: false,
            last_signed: None,
            max_skew_ms: super::command::DEFAULT_MAX_SKEW_MS,
        }
    }
}

/// An accepted document.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Opened {
    /// `issued_ms` when it was signed.
    pub signed: Option<u64>,
    pub offers: Vec<Offer>,
    /// Entries left out: (bundle id, why).
    pub skipped: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DocumentError {
    #[error("manifest document of {0} bytes, over the limit")]
    TooLarge(usize),
    #[error("manifest document: {0}")]
    Malformed(String),
    #[error("manifest document signature: {0}")]
    Signature(String),
    #[error(
        "manifest document issued at {issued}, before the last one accepted ({last}): a replay"
    )]
    Replay { issued: u64, last: u64 },
    #[error(
        "manifest document issued at {issued}, {ahead_ms} ms ahead of this device's clock (over the allowed skew)"
    )]
    Future { issued: u64, ahead_ms: u64 },
    #[error("manifest document is not signed, and {0}")]
    Unsigned(&'static str),
}

impl DocumentError {
    /// Short label for the counter.
    pub fn reason(&self) -> &'static str {
        match self {
            DocumentError::TooLarge(_) | DocumentError::Malformed(_) => "malformed",
            DocumentError::Signature(_) => "signature",
            DocumentError::Replay { .. } => "replay",
            DocumentError::Future { .. } => "future",
            DocumentError::Unsigned(_) => "unsigned",
        }
    }
}

/// Signs a document (fleet side): `issued_ms` and the entries.
pub fn seal(key: &SigningKey, doc: &SignedDocument) -> Result<Envelope, serde_json::Error> {
    let text = serde_json::to_string(doc)?;
    let digest: [u8; 32] = Sha256::digest(text.as_bytes()).into();
    Ok(Envelope {
        signature: sign::sign_digest_in(MANIFEST_CONTEXT, key, &digest),
        document: text,
    })
}

/// Reads a polled document under `policy`; `now_ms` is the device's clock
/// (Unix milliseconds).
pub fn open(body: &[u8], policy: &Policy, now_ms: u64) -> Result<Opened, DocumentError> {
    if body.len() > MAX_DOCUMENT_BYTES {
        return Err(DocumentError::TooLarge(body.len()));
    }
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| DocumentError::Malformed(e.to_string()))?;
    let signed = v.get("document").is_some();
    if !signed {
        if policy.require_signed {
            return Err(DocumentError::Unsigned(
                "this device requires signed ones (require_signed_manifest)",
            ));
        }
        if policy.last_signed.is_some() {
            return Err(DocumentError::Unsigned(
                "this device has accepted signed ones before",
            ));
        }
        let doc: Document =
            serde_json::from_value(v).map_err(|e| DocumentError::Malformed(e.to_string()))?;
        let mut out = Opened::default();
        for o in doc.bundles {
            if o.rollout.is_some() || !o.groups.is_empty() {
                out.skipped.push((
                    o.id(),
                    "rollout or groups in an unsigned document (sign the document)".into(),
                ));
            } else {
                out.offers.push(o);
            }
        }
        return Ok(out);
    }
    let env: Envelope =
        serde_json::from_value(v).map_err(|e| DocumentError::Malformed(e.to_string()))?;
    let digest: [u8; 32] = Sha256::digest(env.document.as_bytes()).into();
    sign::verify_digest_in(MANIFEST_CONTEXT, &policy.trusted, &digest, &env.signature)
        .map_err(|e| DocumentError::Signature(e.to_string()))?;
    let doc: SignedDocument = serde_json::from_str(&env.document)
        .map_err(|e| DocumentError::Malformed(format!("signed but not a document: {e}")))?;
    // Before the replay check, as for commands: a document from the far
    // future must never become the floor that refuses the current ones.
    if doc.issued_ms > now_ms.saturating_add(policy.max_skew_ms) {
        return Err(DocumentError::Future {
            issued: doc.issued_ms,
            ahead_ms: doc.issued_ms - now_ms,
        });
    }
    if let Some(last) = policy.last_signed
        && doc.issued_ms < last
    {
        return Err(DocumentError::Replay {
            issued: doc.issued_ms,
            last,
        });
    }
    let mut out = Opened {
        signed: Some(doc.issued_ms),
        ..Opened::default()
    };
    for o in doc.bundles {
        let problems = rollout::validate(&o);
        if problems.is_empty() {
            out.offers.push(o);
        } else {
            out.skipped.push((o.id(), problems.join("; ")));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ota::bundle::BundleKind;
    use crate::ota::rollout::Rollout;

    fn offer(version: &str, percent: Option<u8>, groups: &[&str]) -> Offer {
        Offer {
            kind: BundleKind::Model,
            name: "m".into(),
            version: version.into(),
            url: "m.tar".into(),
            sha256: "ab".repeat(32),
            size: 10,
            signature: "ed25519:x:y".into(),
            rollback: false,
            rollout: percent.map(|p| Rollout {
                percent: p,
                salt: "s".into(),
            }),
            groups: groups.iter().map(|g| g.to_string()).collect(),
        }
    }

    fn sealed(k: &SigningKey, issued_ms: u64, bundles: Vec<Offer>) -> Vec<u8> {
        let e = seal(k, &SignedDocument { issued_ms, bundles }).unwrap();
        serde_json::to_vec(&e).unwrap()
    }

    /// The device's clock in these tests (Unix ms).
    const NOW: u64 = 1_000_000;

    fn policy(k: &SigningKey) -> Policy {
        Policy {
            trusted: vec![k.verifying_key()],
            ..Policy::default()
        }
    }

    #[test]
    fn a_signed_document_carries_its_waves() {
        let k = sign::generate().unwrap();
        let body = sealed(
            &k,
            1000,
            vec![
                offer("1.1.0", Some(10), &["pilot"]),
                offer("2.0.0", None, &[]),
            ],
        );
        let o = open(&body, &policy(&k), NOW).unwrap();
        assert_eq!(o.signed, Some(1000));
        assert_eq!(o.offers.len(), 2);
        assert_eq!(o.offers[0].rollout.as_ref().unwrap().percent, 10);
        assert_eq!(o.offers[0].groups, vec!["pilot".to_string()]);
        // The same document again is no replay; an older one is.
        let mut p = policy(&k);
        p.last_signed = Some(1000);
        assert!(open(&body, &p, NOW).is_ok());
        p.last_signed = Some(1001);
        assert_eq!(open(&body, &p, NOW).unwrap_err().reason(), "replay");
        // Bad targeting leaves that entry out, not the document.
        let bad = sealed(
            &k,
            2000,
            vec![offer("1.1.0", Some(150), &[]), offer("2.0.0", None, &[])],
        );
        let o = open(&bad, &policy(&k), NOW).unwrap();
        assert_eq!(o.offers.len(), 1);
        assert!(o.skipped[0].1.contains("percent"), "{:?}", o.skipped);
    }

    #[test]
    fn a_document_from_the_far_future_is_refused_and_sets_no_floor() {
        let k = sign::generate().unwrap();
        let mut p = policy(&k);
        p.max_skew_ms = 600_000;
        // Dated 2100: refused as from the future, not taken as the floor.
        let far = sealed(&k, 4_102_444_800_000, vec![offer("9.9.9", None, &[])]);
        let err = open(&far, &p, NOW).unwrap_err();
        assert_eq!(err.reason(), "future");
        assert!(
            err.to_string().contains("ahead of this device's clock"),
            "{err}"
        );
        // Within the skew: taken.
        let near = sealed(&k, NOW + 1000, vec![offer("1.1.0", None, &[])]);
        assert_eq!(open(&near, &p, NOW).unwrap().signed, Some(NOW + 1000));
    }

    #[test]
    fn an_edit_cannot_widen_a_wave() {
        let k = sign::generate().unwrap();
        let other = sign::generate().unwrap();
        let body = sealed(&k, 1000, vec![offer("1.1.0", Some(10), &[])]);
        // Raising the percent inside the signed text breaks the signature.
        let mut env: Envelope = serde_json::from_slice(&body).unwrap();
        env.document = env.document.replace("\"percent\":10", "\"percent\":100");
        assert!(env.document.contains("\"percent\":100"));
        let edited = serde_json::to_vec(&env).unwrap();
        assert_eq!(
            open(&edited, &policy(&k), NOW).unwrap_err().reason(),
            "signature"
        );
        // Signed by a key the device does not trust.
        let foreign = sealed(&other, 1000, vec![offer("1.1.0", Some(100), &[])]);
        assert_eq!(
            open(&foreign, &policy(&k), NOW).unwrap_err().reason(),
            "signature"
        );
        // A bundle or command signature over the same bytes is no document's.
        let digest: [u8; 32] = Sha256::digest(env.document.as_bytes()).into();
        env.signature = sign::sign_digest(&k, &digest);
        assert_eq!(
            open(&serde_json::to_vec(&env).unwrap(), &policy(&k), NOW)
                .unwrap_err()
                .reason(),
            "signature"
        );
        env.signature = sign::sign_digest_in(sign::COMMAND_CONTEXT, &k, &digest);
        assert_eq!(
            open(&serde_json::to_vec(&env).unwrap(), &policy(&k), NOW)
                .unwrap_err()
                .reason(),
            "signature"
        );
        // A plain document: targeted entries are skipped, plain ones offered.
        let plain = serde_json::to_vec(&Document {
            bundles: vec![
                offer("1.1.0", Some(100), &[]),
                offer("1.2.0", None, &["a"]),
                offer("2.0.0", None, &[]),
            ],
        })
        .unwrap();
        let o = open(&plain, &policy(&k), NOW).unwrap();
        assert_eq!(o.signed, None);
        assert_eq!(o.offers.len(), 1);
        assert_eq!(o.offers[0].version, "2.0.0");
        assert_eq!(o.skipped.len(), 2);
        // ...unless the device requires signed documents or has seen one.
        let mut p = policy(&k);
        p.require_signed = true;
        assert_eq!(open(&plain, &p, NOW).unwrap_err().reason(), "unsigned");
        let mut p = policy(&k);
        p.last_signed = Some(1);
        assert_eq!(open(&plain, &p, NOW).unwrap_err().reason(), "unsigned");
        for junk in [
            &b"{"[..],
            b"\"x\"",
            b"{\"document\":1}",
            b"{\"bundles\":[{}]}",
        ] {
            assert_eq!(
                open(junk, &policy(&k), NOW).unwrap_err().reason(),
                "malformed"
            );
        }
    }
}
