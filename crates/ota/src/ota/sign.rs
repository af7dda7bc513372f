//! Ed25519 keys and bundle signatures.
//!
//! What is signed: the message `outpost-bundle-v1:` followed by the 32 raw
//! bytes of the bundle file's SHA-256. Hashing once serves both the size /
//! checksum check and the signature, and the prefix keeps a bundle key from
//! ever signing anything that could be mistaken for another protocol's data.
//!
//! A signature travels as one line of text,
//! `ed25519:<public key, base64>:<signature, base64>` (the `.sig` file and
//! the `signature` field of the manifest document). The key in it only tells
//! "unknown key" from "bad signature"; trust comes from the device's
//! `trusted_keys` alone.
//!
//! Key files: the private key is the base64 of its 32-byte seed (mode 0600),
//! the public key the base64 of its 32 bytes (`KEY.pub`).

use std::io::Write;
use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};

const CONTEXT: &[u8] = b"outpost-bundle-v1:";

#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: not an ed25519 key (32 bytes as base64 or hex, or a file holding one)")]
    BadKey { what: String },
    #[error("signature is not `ed25519:<key>:<signature>` in base64")]
    BadSignatureText,
    #[error("signed by key {key}, which is not trusted here")]
    UnknownKey { key: String },
    #[error("bad signature (key {key})")]
    BadSignature { key: String },
    #[error("random seed from the OS: {0}")]
    Random(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SignError + '_ {
    move |source| SignError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A new key from the OS's random source.
pub fn generate() -> Result<SigningKey, SignError> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| SignError::Random(e.to_string()))?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Writes `out` (private, 0600, never overwriting) and `out.pub`.
pub fn write_keypair(key: &SigningKey, out: &Path) -> Result<PathBuf, SignError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .map_err(io(out))?;
    writeln!(f, "{}", B64.encode(key.to_bytes())).map_err(io(out))?;
    f.sync_all().map_err(io(out))?;
    let mut p = out.as_os_str().to_owned();
    p.push(".pub");
    let pubpath = PathBuf::from(p);
    std::fs::write(
        &pubpath,
        format!("{}\n", B64.encode(key.verifying_key().to_bytes())),
    )
    .map_err(io(&pubpath))?;
    Ok(pubpath)
}

fn decode32(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    let bytes = if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        hex::decode(s).ok()?
    } else {
        B64.decode(s).ok()?
    };
    bytes.try_into().ok()
}

pub fn read_signing_key(path: &Path) -> Result<SigningKey, SignError> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    decode32(&text)
        .map(|b| SigningKey::from_bytes(&b))
        .ok_or_else(|| SignError::BadKey {
            what: path.display().to_string(),
        })
}

/// A public key given inline (base64 or hex) or as a file holding one.
pub fn parse_public_key(s: &str) -> Result<VerifyingKey, SignError> {
    let bad = || SignError::BadKey {
        what: s.to_string(),
    };
    let bytes = match decode32(s) {
        Some(b) => b,
        None => {
            let p = Path::new(s.trim());
            let text = std::fs::read_to_string(p).map_err(|_| bad())?;
            decode32(&text).ok_or_else(bad)?
        }
    };
    VerifyingKey::from_bytes(&bytes).map_err(|_| bad())
}

pub fn key_text(k: &VerifyingKey) -> String {
    B64.encode(k.to_bytes())
}

/// What a signed update command is signed under (see `command.rs`).
pub const COMMAND_CONTEXT: &[u8] = b"outpost-command-v1:";

fn message_in(context: &[u8], digest: &[u8; 32]) -> Vec<u8> {
    let mut m = context.to_vec();
    m.extend_from_slice(digest);
    m
}

/// The signature line for a bundle of this sha256.
pub fn sign_digest(key: &SigningKey, digest: &[u8; 32]) -> String {
    sign_digest_in(CONTEXT, key, digest)
}

/// Checks a bundle's signature line against the trusted keys.
pub fn verify_digest(
    trusted: &[VerifyingKey],
    digest: &[u8; 32],
    line: &str,
) -> Result<VerifyingKey, SignError> {
    verify_digest_in(CONTEXT, trusted, digest, line)
}

/// A signature line over `context` + `digest`: each kind of signed thing has
/// its own context, so a signature never serves another kind.
pub fn sign_digest_in(context: &[u8], key: &SigningKey, digest: &[u8; 32]) -> String {
    let sig = key.sign(&message_in(context, digest));
    format!(
        "ed25519:{}:{}",
        key_text(&key.verifying_key()),
        B64.encode(sig.to_bytes())
    )
}

/// Checks a signature line over `context` + `digest` against the trusted keys.
pub fn verify_digest_in(
    context: &[u8],
    trusted: &[VerifyingKey],
    digest: &[u8; 32],
    line: &str,
) -> Result<VerifyingKey, SignError> {
    let mut parts = line.trim().splitn(3, ':');
    let (Some("ed25519"), Some(k), Some(s)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(SignError::BadSignatureText);
    };
    let key = decode32(k)
        .and_then(|b| VerifyingKey::from_bytes(&b).ok())
        .ok_or(SignError::BadSignatureText)?;
    let sig: [u8; 64] = B64
        .decode(s)
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or(SignError::BadSignatureText)?;
    let key_s = key_text(&key);
    let Some(t) = trusted.iter().find(|t| **t == key) else {
        return Err(SignError::UnknownKey { key: key_s });
    };
    t.verify_strict(&message_in(context, digest), &Signature::from_bytes(&sig))
        .map_err(|_| SignError::BadSignature { key: key_s })?;
    Ok(*t)
}

/// sha256 and size of a file, read in blocks.
pub fn sha256_file(path: &Path) -> Result<([u8; 32], u64), SignError> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(io(path))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((h.finalize().into(), n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_verify_and_the_ways_it_fails() {
        let k = generate().unwrap();
        let other = generate().unwrap();
        let d = [7u8; 32];
        let line = sign_digest(&k, &d);
        let trusted = [other.verifying_key(), k.verifying_key()];
        assert_eq!(
            verify_digest(&trusted, &d, &line).unwrap(),
            k.verifying_key()
        );
        assert!(matches!(
            verify_digest(&trusted, &[8u8; 32], &line),
            Err(SignError::BadSignature { .. })
        ));
        assert!(matches!(
            verify_digest(&[other.verifying_key()], &d, &line),
            Err(SignError::UnknownKey { .. })
        ));
        assert!(matches!(
            verify_digest(&trusted, &d, "garbage"),
            Err(SignError::BadSignatureText)
        ));
        // A bundle signature is no command signature, and the other way round.
        assert!(matches!(
            verify_digest_in(COMMAND_CONTEXT, &trusted, &d, &line),
            Err(SignError::BadSignature { .. })
        ));
        let cmd = sign_digest_in(COMMAND_CONTEXT, &k, &d);
        assert!(verify_digest_in(COMMAND_CONTEXT, &trusted, &d, &cmd).is_ok());
        assert!(verify_digest(&trusted, &d, &cmd).is_err());
    }

    #[test]
    fn keys_round_trip_through_files_hex_and_base64() {
        let dir = tempfile::tempdir().unwrap();
        let k = generate().unwrap();
        let path = dir.path().join("key");
        let pubp = write_keypair(&k, &path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(write_keypair(&k, &path).is_err(), "never overwrites a key");
        assert_eq!(read_signing_key(&path).unwrap().to_bytes(), k.to_bytes());
        let v = k.verifying_key();
        assert_eq!(parse_public_key(pubp.to_str().unwrap()).unwrap(), v);
        assert_eq!(parse_public_key(&key_text(&v)).unwrap(), v);
        assert_eq!(parse_public_key(&hex::encode(v.to_bytes())).unwrap(), v);
        assert!(parse_public_key("nope").is_err());
    }
}
