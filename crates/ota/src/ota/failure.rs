//! Why a step of an update failed, as the state machine sees it: an I/O
//! error keeps its [`std::io::ErrorKind`] (a full disk is not a refused
//! permission), anything else is told in words.

use std::io::ErrorKind;

/// A failed step's cause, carried by the state machine's events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// An I/O error somewhere in the cause's chain: its kind decides.
    #[error("{detail}")]
    Io { kind: ErrorKind, detail: String },
    /// The bundle, the model, the network: what failed, in words.
    #[error("{0}")]
    Other(String),
}

impl Failure {
    /// The failure an error stands for: `Io` when an `io::Error` is in its
    /// chain of causes (the kind of the first one), with the error's text.
    pub fn of(e: &(dyn std::error::Error + 'static)) -> Failure {
        let mut text = e.to_string();
        let mut kind = e.downcast_ref::<std::io::Error>().map(|io| io.kind());
        let mut cur = e.source();
        while let Some(c) = cur {
            if kind.is_none() {
                kind = c.downcast_ref::<std::io::Error>().map(|io| io.kind());
            }
            let more = c.to_string();
            if !text.contains(&more) {
                text.push_str(": ");
                text.push_str(&more);
            }
            cur = c.source();
        }
        match kind {
            Some(kind) => Failure::Io { kind, detail: text },
            None => Failure::Other(text),
        }
    }

    /// The device's disk is full (or over its quota): the bundle is not to
    /// blame, and the step is tried again once there is room.
    pub fn disk_full(&self) -> bool {
        matches!(
            self,
            Failure::Io {
                kind: ErrorKind::StorageFull | ErrorKind::QuotaExceeded,
                ..
            }
        )
    }

    /// The I/O error's kind, if the failure is one.
    pub fn io_kind(&self) -> Option<ErrorKind> {
        match self {
            Failure::Io { kind, .. } => Some(*kind),
            Failure::Other(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ota::install::InstallError;

    fn install_io(kind: ErrorKind) -> InstallError {
        InstallError::Io {
            what: "write",
            path: "/data/ota/staging/m/2/model.onnx".into(),
            source: std::io::Error::from(kind),
        }
    }

    /// The kind of the I/O error inside an install error reaches the
    /// failure the state machine gets: a full disk and a refused
    /// permission are told apart.
    #[test]
    fn a_full_disk_and_a_refused_permission_are_told_apart() {
        let full = Failure::of(&install_io(ErrorKind::StorageFull));
        let denied = Failure::of(&install_io(ErrorKind::PermissionDenied));
        assert_eq!(full.io_kind(), Some(ErrorKind::StorageFull));
        assert_eq!(denied.io_kind(), Some(ErrorKind::PermissionDenied));
        assert!(full.disk_full());
        assert!(!denied.disk_full());
        assert!(full.to_string().contains("/data/ota/staging"), "{full}");
    }

    #[test]
    fn an_error_without_io_in_its_chain_is_told_in_words() {
        let e = InstallError::NoBinary("outpostd");
        let f = Failure::of(&e);
        assert_eq!(f.io_kind(), None);
        assert!(!f.disk_full());
        assert_eq!(f.to_string(), e.to_string());
    }
}
