//! Replays detections through outpost's tracker offline: the same
//! `StreamTracker` a pipeline runs, fed from a MOTChallenge-format file
//! instead of a detector, for `perf/track_quality`.
//!
//! Input (`--detections`): one detection a line, `frame,id,left,top,width,
//! height,score[,...]` (the MOTChallenge `det.txt` layout; `id` is ignored,
//! frames count from 1), every detection labelled `--label`. Frame `f`
//! happens at `(f - 1) / fps` seconds.
//!
//! Output (`--tracks`, or stdout): the tracked boxes in the MOTChallenge
//! result layout, `frame,track,left,top,width,height,score,-1,-1,-1`, one
//! line per detection that belongs to a confirmed track (its `{n}`), the
//! detection's own box. Tentative tracks are left out, as a pipeline's
//! records leave them out. A summary goes to stderr as one JSON line:
//! frames, detections, tracks started and ended, re-links.
//!
//! Usage: cargo run --example track_replay -- --detections det.txt --fps 25

// A failed unwrap here is a failed run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::Parser;
use outpost::track::{Detection, EventKind, StreamTracker, TrackConfig, TrackStats, TrackingSpec};

#[derive(Parser, Debug)]
struct Args {
    /// MOTChallenge-format detections.
    #[arg(long)]
    detections: std::path::PathBuf,
    /// Where the tracks go (default: stdout).
    #[arg(long)]
    tracks: Option<std::path::PathBuf>,
    /// Frames per second of the sequence.
    #[arg(long, default_value_t = 25.0)]
    fps: f64,
    /// The label every detection gets.
    #[arg(long, default_value = "person")]
    label: String,
    /// `[pipelines.track]` as TOML (e.g. `max_age = "2s"`); defaults when
    /// left out.
    #[arg(long, default_value = "")]
    config: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !(args.fps.is_finite() && args.fps > 0.0) {
        bail!("--fps must be a positive number, not {}", args.fps);
    }
    let config: TrackConfig = toml::from_str(&args.config).context("--config")?;
    let text = std::fs::read_to_string(&args.detections)
        .with_context(|| format!("reading {}", args.detections.display()))?;
    let mut frames: BTreeMap<u64, Vec<Detection>> = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f.len() < 7 {
            bail!("line {}: {} fields, at least 7 expected", n + 1, f.len());
        }
        let num = |i: usize| -> anyhow::Result<f32> {
            f[i].parse::<f32>()
                .with_context(|| format!("line {}: field {} is not a number", n + 1, i + 1))
        };
        let frame: u64 = f[0]
            .parse()
            .with_context(|| format!("line {}: frame is not a whole number", n + 1))?;
        if frame == 0 {
            bail!("line {}: frames count from 1", n + 1);
        }
        let (x, y, w, h, score) = (num(2)?, num(3)?, num(4)?, num(5)?, num(6)?);
        frames.entry(frame).or_default().push(Detection {
            bbox: [x, y, x + w, y + h],
            score,
            label: args.label.clone(),
            text: None,
        });
    }
    let last = frames.keys().next_back().copied().unwrap_or(0);
    let spec = Arc::new(TrackingSpec::new(config, &[], &[]));
    let mut tracker = StreamTracker::new(
        spec,
        Arc::new(TrackStats::default()),
        String::new(),
        Arc::new(1.into()),
    );
    let mut out = String::new();
    let (mut started, mut ended, mut relinks, mut dets) = (0u64, 0u64, 0u64, 0usize);
    let empty = Vec::new();
    let mut at = UNIX_EPOCH;
    for frame in 1..=last {
        at = UNIX_EPOCH + Duration::from_secs_f64((frame - 1) as f64 / args.fps);
        let d = frames.get(&frame).unwrap_or(&empty);
        dets += d.len();
        let o = tracker.update(at, d);
        for (det, t) in d.iter().zip(&o.objects) {
            let Some(n) = t.n else { continue };
            let b = det.bbox;
            out.push_str(&format!(
                "{frame},{n},{:.2},{:.2},{:.2},{:.2},{:.3},-1,-1,-1\n",
                b[0],
                b[1],
                b[2] - b[0],
                b[3] - b[1],
                det.score
            ));
        }
        for e in &o.events {
            match &e.kind {
                EventKind::TrackStart { .. } => started += 1,
                EventKind::TrackEnd(s) => {
                    ended += 1;
                    relinks += u64::from(s.relinked);
                }
                _ => {}
            }
        }
    }
    for e in tracker.finish(outpost::track::EndReason::Restart, at) {
        if let EventKind::TrackEnd(s) = &e.kind {
            ended += 1;
            relinks += u64::from(s.relinked);
        }
    }
    match &args.tracks {
        Some(p) => std::fs::write(p, out).with_context(|| format!("writing {}", p.display()))?,
        None => std::io::stdout().write_all(out.as_bytes())?,
    }
    eprintln!(
        "{{\"frames\": {last}, \"detections\": {dets}, \"track_start\": {started}, \
         \"track_end\": {ended}, \"relinked\": {relinks}}}"
    );
    Ok(())
}
