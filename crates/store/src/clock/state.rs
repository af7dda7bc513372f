//! `<data_dir>/clock.json`: the last known good time and the offsets of
//! recent boots, replaced atomically (a crash leaves the old file or the
//! new one).

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Boots whose offsets are kept: records of an older boot still waiting
/// in the outbox keep their unsynced mark.
pub const MAX_BOOTS: usize = 8;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedClock {
    /// A lower bound of the real time when it was saved (unix µs).
    pub last_good_us: i64,
    /// The boot it was saved in, and its time since boot then: a daemon of
    /// the same boot carries the bound on by the time since.
    pub boot_id: String,
    pub since_boot_us: u64,
    /// Records of `boot_id` may carry the unsynced mark and no offset is
    /// known for them yet.
    #[serde(default)]
    pub pending: bool,
    /// Newest first: each boot's system clock − time since boot, from a
    /// trusted reading.
    #[serde(default)]
    pub boots: Vec<BootOffset>,
    /// The newest time the fleet confirmed (unix µs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmed_us: Option<i64>,
    /// Written by a daemon that never takes the last known good time from a
    /// clock far ahead of its references; a file without it may hold one
    /// (a first start at 2100) and is checked at load.
    #[serde(default)]
    pub bounded: bool,
    /// Written by a daemon that takes a confirmed time only where the
    /// system clock agrees with it (and a `Date` only over verified TLS); a
    /// file without it may hold a fleet's `Date` taken as it came.
    #[serde(default)]
    pub confirmed_agreed: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootOffset {
    pub boot_id: String,
    pub offset_us: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a clock state: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
}

impl SavedClock {
    /// Reads the file; `Ok(None)` when there is none yet.
    pub fn load(path: &Path) -> Result<Option<SavedClock>, StateError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(StateError::Io {
                    path: path.display().to_string(),
                    source,
                });
            }
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| StateError::Parse {
                path: path.display().to_string(),
                source,
            })
    }

    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        let io = |source| StateError::Io {
            path: path.display().to_string(),
            source,
        };
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| io(std::io::Error::other(e)))?;
        crate::fsio::write_atomic(path, &bytes).map_err(io)
    }

    /// The offset of `boot_id`, if known.
    pub fn offset_of(&self, boot_id: &str) -> Option<i64> {
        self.boots
            .iter()
            .find(|b| b.boot_id == boot_id)
            .map(|b| b.offset_us)
    }

    /// Records `boot_id`'s offset, newest first, at most [`MAX_BOOTS`].
    pub fn set_offset(&mut self, boot_id: &str, offset_us: i64) {
        self.boots.retain(|b| b.boot_id != boot_id);
        self.boots.insert(
            0,
            BootOffset {
                boot_id: boot_id.to_string(),
                offset_us,
            },
        );
        self.boots.truncate(MAX_BOOTS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saves_loads_and_keeps_the_newest_boots() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("clock.json");
        assert!(SavedClock::load(&p).unwrap().is_none());
        let mut s = SavedClock {
            last_good_us: 1_796_083_200_000_000,
            boot_id: "b".into(),
            since_boot_us: 5,
            pending: true,
            boots: Vec::new(),
            confirmed_us: Some(1_796_083_100_000_000),
            bounded: true,
            confirmed_agreed: true,
        };
        for i in 0..10 {
            s.set_offset(&format!("boot-{i}"), i);
        }
        s.set_offset("boot-3", 33);
        assert_eq!(s.boots.len(), MAX_BOOTS);
        assert_eq!(s.offset_of("boot-3"), Some(33));
        assert_eq!(s.boots[0].boot_id, "boot-3");
        assert_eq!(s.offset_of("boot-0"), None);
        s.save(&p).unwrap();
        assert_eq!(SavedClock::load(&p).unwrap(), Some(s));
        std::fs::write(&p, b"{").unwrap();
        assert!(matches!(
            SavedClock::load(&p),
            Err(StateError::Parse { .. })
        ));
    }
}
