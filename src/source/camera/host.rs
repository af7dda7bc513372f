//! The daemon's running cameras, kept across reloads.
//!
//! Invariants:
//! - A camera outlives the generation that started it while its
//!   definition (the `[[cameras]]` entry, or an inline camera's settings)
//!   stays the same, and for a V4L2 or CSI camera the rate asked of it: a reload hands it the new
//!   generation's pipelines as readers, and its RTSP session, decoder and
//!   keyframe watch run on. Adding a camera to a pipeline, or removing
//!   one, leaves the others' decoders as they are (their trackers and
//!   open tracks are the pipeline's, kept by the reload itself).
//! - Between a generation's stop and the next one's start its cameras are
//!   parked: they decode on but hand no frame to anyone, so no frame lands
//!   in a stopped pipeline's queue.
//! - A camera that no pipeline of the new config reads, or whose
//!   definition changed, is stopped (its session closed, its pipeline torn
//!   down) before any camera of the new config starts: a camera that
//!   allows one session is never asked for two.

use tokio_util::sync::CancellationToken;

use super::{CameraDef, CameraKey, CameraSet, Running, SharedDecoders, asked_fps, spawn_camera};
use crate::source::SourceError;

/// A camera as its host keeps it: what it was started as, and the camera.
struct Hosted {
    key: CameraKey,
    def: CameraDef,
    asked_fps: Option<f64>,
    run: Running,
}

/// The running cameras of the daemon, whichever generation reads them.
#[derive(Default)]
pub struct CameraHost {
    cameras: Vec<Hosted>,
    /// Shared by the cameras that decode keyframes only.
    decoders: SharedDecoders,
}

impl CameraHost {
    /// Makes the cameras of `set` run for its readers: a running camera of
    /// the same definition takes them as they are, the others stop, the new
    /// ones start (each stopped by a child of `stop`).
    pub async fn attach(
        &mut self,
        set: CameraSet,
        stop: &CancellationToken,
    ) -> Result<(), SourceError> {
        let wanted = set.resolved()?;
        // The rate asked of the camera matters where the camera is asked
        // for one (V4L2, CSI); an RTSP stream comes as the camera sends it.
        let same = |h: &Hosted| {
            wanted.iter().any(|(key, def, consumers)| {
                h.key == *key
                    && h.def == *def
                    && (is_rtsp(def) || h.asked_fps == asked_fps(consumers))
            })
        };
        let (kept, gone): (Vec<Hosted>, Vec<Hosted>) = std::mem::take(&mut self.cameras)
            .into_iter()
            .partition(same);
        for h in &gone {
            tracing::info!(name = %h.def.name, "camera stopped: no longer read as it was");
        }
        stop_all(gone).await;
        self.cameras = kept;
        for (key, def, consumers) in wanted {
            match self.cameras.iter().find(|h| h.key == key) {
                Some(h) => h.run.swap(consumers),
                None => {
                    let asked_fps = asked_fps(&consumers);
                    let run =
                        spawn_camera(def.clone(), consumers, stop.child_token(), &self.decoders)?;
                    self.cameras.push(Hosted {
                        key,
                        def,
                        asked_fps,
                        run,
                    });
                }
            }
        }
        Ok(())
    }

    /// The readers' generation is stopping: from now on no camera hands
    /// frames to it.
    pub fn park(&self) {
        for h in &self.cameras {
            h.run.park();
        }
    }

    /// Stops every camera and waits until each is torn down.
    pub async fn stop(&mut self) {
        stop_all(std::mem::take(&mut self.cameras)).await;
    }
}

/// Stops cameras together, then waits for each.
async fn stop_all(cameras: Vec<Hosted>) {
    for h in &cameras {
        h.run.cancel();
    }
    for h in cameras {
        h.run.join().await;
    }
}

fn is_rtsp(def: &CameraDef) -> bool {
    def.url
        .as_deref()
        .is_some_and(|u| u.to_ascii_lowercase().starts_with("rtsp"))
}
