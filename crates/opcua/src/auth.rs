//! Who may open a session: the configured users (a password or a
//! certificate), and anonymous clients only when the config says so. Every
//! refusal is counted by reason; no password is ever logged.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use opcua::crypto::{SecurityPolicy, Thumbprint, X509};
use opcua::server::ServerEndpoint;
use opcua::server::authenticator::{
    AuthManager, Password, UserToken, user_pass_security_policy_id, user_pass_security_policy_uri,
};
use opcua::types::{Error, StatusCode, UAString, UserTokenPolicy, UserTokenType};
use parking_lot::Mutex;

/// The policy ids the server's identity token handling expects.
const POLICY_ID_ANONYMOUS: &str = "anonymous";
const POLICY_ID_X509: &str = "x509";

/// How a user proves who they are.
pub(crate) enum Secret {
    Password(String),
    Certificate(Thumbprint),
}

/// One user, ready to check.
pub(crate) struct User {
    pub(crate) name: String,
    pub(crate) secret: Secret,
}

/// Logins by outcome.
#[derive(Default)]
pub struct AuthStats {
    pub(crate) accepted: AtomicU64,
    refused: Mutex<BTreeMap<&'static str, u64>>,
}

impl AuthStats {
    /// Refused logins by reason (`anonymous`, `password`, `user`, `certificate`).
    pub fn refused(&self) -> BTreeMap<&'static str, u64> {
        self.refused.lock().clone()
    }

    /// Logins accepted since the start.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    fn refuse(&self, reason: &'static str) -> Error {
        *self.refused.lock().entry(reason).or_default() += 1;
        Error::new(StatusCode::BadIdentityTokenRejected, "login refused")
    }
}

pub(crate) struct Auth {
    pub(crate) anonymous: bool,
    pub(crate) users: Vec<User>,
    pub(crate) stats: std::sync::Arc<AuthStats>,
}

/// Compares in a time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(!x);
    }
    diff == 0
}

/// Why a user's certificate file gives no thumbprint.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CertificateError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not an X.509 certificate: {reason}")]
    NotX509 { path: String, reason: String },
}

/// A user's certificate thumbprint, from a DER or PEM file.
pub(crate) fn thumbprint(path: &std::path::Path) -> Result<Thumbprint, CertificateError> {
    let shown = || path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| CertificateError::Read {
        path: shown(),
        source,
    })?;
    let cert = if bytes.starts_with(b"-----BEGIN") {
        X509::from_pem(&bytes)
    } else {
        X509::from_der(&bytes)
    }
    .map_err(|e| CertificateError::NotX509 {
        path: shown(),
        reason: e.to_string(),
    })?;
    Ok(cert.thumbprint())
}

impl Auth {
    fn has_passwords(&self) -> bool {
        self.users
            .iter()
            .any(|u| matches!(u.secret, Secret::Password(_)))
    }

    fn has_certificates(&self) -> bool {
        self.users
            .iter()
            .any(|u| matches!(u.secret, Secret::Certificate(_)))
    }
}

#[async_trait]
impl AuthManager for Auth {
    async fn authenticate_anonymous_token(&self, _endpoint: &ServerEndpoint) -> Result<(), Error> {
        if self.anonymous {
            self.stats.accepted.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        tracing::warn!("opcua: an anonymous login was refused (opcua.anonymous = false)");
        Err(self.stats.refuse("anonymous"))
    }

    async fn authenticate_username_identity_token(
        &self,
        _endpoint: &ServerEndpoint,
        username: &str,
        password: &Password,
    ) -> Result<UserToken, Error> {
        let Some(u) = self.users.iter().find(|u| u.name == username) else {
            tracing::warn!(user = %username, "opcua: a login was refused: no such user");
            return Err(self.stats.refuse("user"));
        };
        match &u.secret {
            Secret::Password(p) if same(p.as_bytes(), password.get().as_bytes()) => {
                self.stats.accepted.fetch_add(1, Ordering::Relaxed);
                tracing::info!(user = %u.name, "opcua: user logged in");
                Ok(UserToken(u.name.clone()))
            }
            _ => {
                tracing::warn!(user = %u.name, "opcua: a login was refused: wrong password");
                Err(self.stats.refuse("password"))
            }
        }
    }

    async fn authenticate_x509_identity_token(
        &self,
        _endpoint: &ServerEndpoint,
        signing_thumbprint: &Thumbprint,
    ) -> Result<UserToken, Error> {
        let found = self
            .users
            .iter()
            .find(|u| matches!(&u.secret, Secret::Certificate(t) if t == signing_thumbprint));
        match found {
            Some(u) => {
                self.stats.accepted.fetch_add(1, Ordering::Relaxed);
                tracing::info!(user = %u.name, "opcua: user logged in with a certificate");
                Ok(UserToken(u.name.clone()))
            }
            None => {
                tracing::warn!("opcua: a certificate login was refused: no user has it");
                Err(self.stats.refuse("certificate"))
            }
        }
    }

    fn user_token_policies(&self, endpoint: &ServerEndpoint) -> Vec<UserTokenPolicy> {
        let mut out = Vec::with_capacity(3);
        if self.anonymous {
            out.push(UserTokenPolicy {
                policy_id: UAString::from(POLICY_ID_ANONYMOUS),
                token_type: UserTokenType::Anonymous,
                issued_token_type: UAString::null(),
                issuer_endpoint_url: UAString::null(),
                security_policy_uri: UAString::null(),
            });
        }
        if self.has_passwords() {
            out.push(UserTokenPolicy {
                policy_id: user_pass_security_policy_id(endpoint),
                token_type: UserTokenType::UserName,
                issued_token_type: UAString::null(),
                issuer_endpoint_url: UAString::null(),
                security_policy_uri: user_pass_security_policy_uri(endpoint),
            });
        }
        if self.has_certificates() {
            out.push(UserTokenPolicy {
                policy_id: UAString::from(POLICY_ID_X509),
                token_type: UserTokenType::Certificate,
                issued_token_type: UAString::null(),
                issuer_endpoint_url: UAString::null(),
                security_policy_uri: UAString::from(SecurityPolicy::Basic256Sha256.to_uri()),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_compare_whole() {
        assert!(same(b"secret", b"secret"));
        assert!(!same(b"secret", b"secre"));
        assert!(!same(b"secret", b"secret!"));
        assert!(!same(b"secret", b"Secret"));
        assert!(!same(b"", b"x"));
        assert!(same(b"", b""));
    }
}
