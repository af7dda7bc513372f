//! rustls client configurations for the uplinks: the ring provider only,
//! roots from a CA file or the system's store, an optional client
//! certificate (mTLS).

use std::path::Path;
use std::sync::Arc;

use rustls::ClientConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::UplinkError;

fn tls_err(path: &Path, what: &str, e: impl std::fmt::Display) -> UplinkError {
    UplinkError::Tls {
        path: path.to_path_buf(),
        detail: format!("{what}: {e}"),
    }
}

/// Builds a client config; `ca = None` trusts the system's roots.
pub fn client_config(
    ca: Option<&Path>,
    cert: Option<&Path>,
    key: Option<&Path>,
) -> Result<ClientConfig, UplinkError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(p) => {
            let certs = CertificateDer::pem_file_iter(p)
                .map_err(|e| tls_err(p, "CA file", e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| tls_err(p, "CA file", e))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(tls_err(p, "CA file", "no certificate in it"));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(UplinkError::Setup(
                    "TLS: no CA given and no system root certificates found".into(),
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    // Certificates are checked against the later of the system clock and
    // the last known good time: a device in 1970 still connects.
    let builder = ClientConfig::builder_with_details(provider, Arc::new(crate::clock::TrustedTime))
        .with_safe_default_protocol_versions()
        .map_err(|e| UplinkError::Setup(format!("TLS: {e}")))?
        .with_root_certificates(roots);
    match (cert, key) {
        (Some(c), Some(k)) => {
            let chain = CertificateDer::pem_file_iter(c)
                .map_err(|e| tls_err(c, "client certificate", e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| tls_err(c, "client certificate", e))?;
            if chain.is_empty() {
                return Err(tls_err(c, "client certificate", "no certificate in it"));
            }
            let key = PrivateKeyDer::from_pem_file(k).map_err(|e| tls_err(k, "client key", e))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| tls_err(c, "client certificate and key", e))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// A config that trusts no server: for clients that must have one but do
/// not speak TLS (reqwest with a plain http URL).
pub fn trust_nothing() -> Result<ClientConfig, UplinkError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(
        ClientConfig::builder_with_details(provider, Arc::new(crate::clock::TrustedTime))
            .with_safe_default_protocol_versions()
            .map_err(|e| UplinkError::Setup(format!("TLS: {e}")))?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
    )
}
