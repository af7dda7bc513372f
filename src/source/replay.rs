//! Replay: a recorded file of frames, at the recorded rate or as fast as
//! the pipeline takes them (demos, tests, benchmarks).
//!
//! Format: the magic `OUTPOSTREC1\n`, then records of
//! `[t_us: u64 LE, offset from the first frame][k: u16 LE][k bytes stream][n: u32 LE][n bytes payload]`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Frame, ReplaySpeed, Source, SourceCtx, SourceError};

pub const MAGIC: &[u8] = b"OUTPOSTREC1\n";

#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub t_us: u64,
    pub stream: String,
    pub payload: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    #[error("{0}: not an outpost recording (bad magic)")]
    Magic(String),
    #[error("{path}: truncated at byte {offset}")]
    Truncated { path: String, offset: usize },
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

/// Parses a whole recording.
pub fn parse(bytes: &[u8], name: &str) -> Result<Vec<Recorded>, RecordingError> {
    let Some(mut rest) = bytes.strip_prefix(MAGIC) else {
        return Err(RecordingError::Magic(name.to_string()));
    };
    let mut out = Vec::new();
    let total = bytes.len();
    let trunc = |rest: &[u8]| RecordingError::Truncated {
        path: name.to_string(),
        offset: total - rest.len(),
    };
    while !rest.is_empty() {
        let (t, r) = rest.split_at_checked(8).ok_or_else(|| trunc(rest))?;
        let (k, r) = r.split_at_checked(2).ok_or_else(|| trunc(rest))?;
        let k = u16::from_le_bytes([k[0], k[1]]) as usize;
        let (s, r) = r.split_at_checked(k).ok_or_else(|| trunc(rest))?;
        let (n, r) = r.split_at_checked(4).ok_or_else(|| trunc(rest))?;
        let n = u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize;
        let (p, r) = r.split_at_checked(n).ok_or_else(|| trunc(rest))?;
        let mut tb = [0u8; 8];
        tb.copy_from_slice(t);
        out.push(Recorded {
            t_us: u64::from_le_bytes(tb),
            stream: String::from_utf8_lossy(s).into_owned(),
            payload: p.to_vec(),
        });
        rest = r;
    }
    Ok(out)
}

/// Writes a recording (tools and tests).
pub fn write(path: &Path, frames: &[Recorded]) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(MAGIC)?;
    for r in frames {
        f.write_all(&r.t_us.to_le_bytes())?;
        f.write_all(&(r.stream.len() as u16).to_le_bytes())?;
        f.write_all(r.stream.as_bytes())?;
        f.write_all(&(r.payload.len() as u32).to_le_bytes())?;
        f.write_all(&r.payload)?;
    }
    f.flush()
}

pub struct ReplaySource {
    pub file: PathBuf,
    pub speed: ReplaySpeed,
    pub repeat: bool,
}

impl Source for ReplaySource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        let shown = self.file.display().to_string();
        let setup = |detail: String| SourceError::Setup {
            pipeline: ctx.pipeline.clone(),
            kind: "replay",
            detail,
        };
        let mut bytes = Vec::new();
        std::fs::File::open(&self.file)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|e| setup(RecordingError::Io(shown.clone(), e).to_string()))?;
        let frames = parse(&bytes, &shown).map_err(|e| setup(e.to_string()))?;
        tracing::info!(pipeline = %ctx.pipeline, file = %shown, frames = frames.len(), "replay source");
        Ok(tokio::spawn(async move {
            loop {
                let start = Instant::now();
                for r in &frames {
                    if self.speed == ReplaySpeed::Recorded {
                        let due = start + Duration::from_micros(r.t_us);
                        tokio::select! {
                            _ = tokio::time::sleep_until(due.into()) => {}
                            _ = ctx.stopped() => return,
                        }
                    }
                    if !ctx
                        .submit(Frame::new(
                            r.stream.as_str(),
                            Bytes::copy_from_slice(&r.payload),
                        ))
                        .await
                    {
                        return;
                    }
                }
                if !self.repeat {
                    tracing::info!(pipeline = %ctx.pipeline, "replay finished");
                    ctx.stopped().await;
                    return;
                }
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.rec");
        let frames = vec![
            Recorded {
                t_us: 0,
                stream: "a".into(),
                payload: vec![1, 2, 3],
            },
            Recorded {
                t_us: 32_000,
                stream: "b".into(),
                payload: vec![],
            },
        ];
        write(&p, &frames).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(parse(&bytes, "r").unwrap(), frames);
        assert!(matches!(
            parse(&bytes[..bytes.len() - 1], "r"),
            Err(RecordingError::Truncated { .. })
        ));
        assert!(matches!(parse(b"nope", "r"), Err(RecordingError::Magic(_))));
    }

    proptest! {
        #[test]
        fn parse_never_panics(tail in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut b = MAGIC.to_vec();
            b.extend(tail);
            let _ = parse(&b, "fuzz");
        }
    }
}
