//! The daemon: builds everything a config describes, runs it, reloads it,
//! stops it.
//!
//! Start order: ONNX Runtime -> outbox -> models (loaded and warmed) ->
//! pipelines (and the embedded broker, when one needs it) -> workers ->
//! local outputs -> sources -> uplink -> OTA agent -> API; then READY to
//! systemd, and `/readyz` answers 200.
//!
//! Reload (SIGHUP or `POST /v1/reload`): the new config is loaded and
//! checked, its models loaded (unchanged ones are reused) and its pipelines
//! built while the old ones keep serving; only then the old sources stop,
//! the old workers finish every frame they took in, and the new generation
//! starts. The outbox and the uplink are not touched, so nothing stored or
//! in flight is lost. A config that fails to load, or names a model that
//! cannot be loaded, leaves the old one running; one that fails to start
//! gives way to the previous one again.
//!
//! Stop (SIGTERM, SIGINT): sources stop taking frames, workers finish every
//! queued frame, the uplink stops, the outbox is flushed and fsynced.
//!
//! Watchdog: when systemd sets WATCHDOG_USEC, the daemon pings at a third of
//! it, but only while no worker has spent more than half of it on one batch:
//! a pipeline stuck in inference stops the pings and systemd restarts it.
//!
//! Rooms: this file runs the daemon (start, the signal loop, stop);
//! `process.rs` starts the process-wide parts (outbox, uplink, OTA agent,
//! API); `lifecycle.rs` is the one stop signal they all share;
//! `generation.rs` loads models and builds, starts and stops one config's
//! pipelines; `reload.rs` decides a reload and its fallback; `servers.rs` starts the
//! servers for the site's controllers (OPC UA); `sink.rs` is
//! where results and events are stored; `model_host.rs` is the daemon as
//! the OTA agent sees it; `stats.rs` counts reloads and refused models.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sd_notify::NotifyState;

use crate::config::Config;
use crate::pipeline::realtime::RealtimeStats;

mod error;
mod generation;
mod lifecycle;
mod model_host;
mod process;
mod reload;
mod servers;
mod sink;
mod stats;

pub use error::{DaemonError, GenerationError, Refused};
pub use model_host::DaemonModelHost;
use process::{Daemon, ReloadReply};
use reload::ReloadError;
pub use servers::FloorError;

/// Options of `outpost run` beyond the config.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Print every stored record as one JSON line on stdout.
    pub print_records: bool,
    /// The config file, re-read on reload.
    pub config_path: Option<PathBuf>,
    /// Model directory given on the command line (kept across reloads).
    pub model_dir_override: Option<PathBuf>,
}

fn notify(states: &[NotifyState]) {
    // Outside systemd NOTIFY_SOCKET is unset and this does nothing.
    if let Err(e) = sd_notify::notify(states) {
        tracing::debug!(error = %e, "sd_notify failed");
    }
}
/// Runs the daemon until SIGTERM or SIGINT.
pub fn run(cfg: Config, opts: RunOptions) -> Result<(), DaemonError> {
    // Camera frames: allocator settings before any thread exists (see camera/run.rs).
    #[cfg(feature = "camera")]
    if cfg
        .pipelines
        .iter()
        .any(|p| matches!(p.source, crate::source::SourceConfig::Camera(_)))
    {
        crate::source::camera::bounded_malloc();
    }
    let realtime = Arc::new(RealtimeStats::default());
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder
        .worker_threads(2)
        .enable_all()
        .thread_name("outpost-io");
    // The I/O threads carry frames from the sources and records to the
    // local outputs: under load they need the inference threads' priority,
    // or frames queue in front of a real-time inference thread.
    if let Some(p) = cfg.scheduler.realtime_priority {
        let stats = realtime.clone();
        builder.on_thread_start(move || crate::pipeline::realtime::fifo_io_thread(p, &stats));
    }
    let rt = builder.build().map_err(DaemonError::AsyncRuntime)?;
    let exit = rt.block_on(run_async(cfg, opts, realtime))?;
    drop(rt);
    if exit == Exit::Restart {
        tracing::info!(
            code = crate::ota::slots::RESTART_EXIT,
            "exiting so the service manager starts the new daemon slot"
        );
        std::process::exit(crate::ota::slots::RESTART_EXIT);
    }
    Ok(())
}

/// How serving ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exit {
    /// SIGTERM or SIGINT.
    Stop,
    /// The OTA agent installed a new daemon slot: exit so it starts.
    Restart,
}

/// What the signal loop woke up for.
enum Wake {
    Exit(Exit),
    /// SIGHUP (no answer) or `POST /v1/reload` (answered).
    Reload(Option<ReloadReply>),
    Watchdog,
    Status,
}

async fn run_async(
    cfg: Config,
    opts: RunOptions,
    realtime: Arc<RealtimeStats>,
) -> Result<Exit, DaemonError> {
    // A new daemon slot on trial must say READY in time.
    let deadline = cfg
        .ota
        .as_ref()
        .map(|o| crate::ota::slots::ready_deadline(&cfg.data_dir, o.daemon_ready_timeout));
    if cfg.scheduler.lock_memory {
        crate::pipeline::realtime::lock_memory(&realtime);
    }
    let mut daemon = Daemon::start(cfg, opts, realtime).await?;
    daemon.say_ready();
    if let Some(d) = &deadline {
        d.met();
    }
    let exit = daemon.serve().await;
    daemon.stop().await?;
    Ok(exit)
}

impl Daemon {
    fn status_line(&self) -> String {
        format!(
            "serving {} pipeline(s); outbox {} record(s)",
            self.generation.scheduler.pipelines().len(),
            self.core.outbox.stats().records
        )
    }

    fn say_ready(&self) {
        self.ready.store(true, Ordering::SeqCst);
        // Logged before systemd hears READY: whoever waits on READY finds the
        // bound API address in the log.
        tracing::info!(
            device = %self.core.device,
            boot = self.core.outbox.boot(),
            pipelines = self.generation.scheduler.pipelines().len(),
            workers = self.cfg.scheduler.worker_count(),
            api = %self.api_addr,
            "outpost ready"
        );
        notify(&[NotifyState::Ready, NotifyState::Status(&self.status_line())]);
    }

    /// The signal loop: until SIGTERM, SIGINT or a restart into a new slot.
    async fn serve(&mut self) -> Exit {
        // When systemd sets WATCHDOG_USEC: ping at a third of it.
        let watchdog = sd_notify::watchdog_enabled();
        let mut tick = tokio::time::interval(watchdog.map_or(Duration::from_secs(10), |w| w / 3));
        let mut status_tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            let wake = tokio::select! {
                _ = self.signals.term.recv() => Wake::Exit(Exit::Stop),
                Some(()) = self.restarts.recv() => Wake::Exit(Exit::Restart),
                _ = self.signals.int.recv() => Wake::Exit(Exit::Stop),
                _ = self.signals.hup.recv() => Wake::Reload(None),
                Some(tx) = self.reloads.recv() => Wake::Reload(Some(tx)),
                _ = tick.tick() => Wake::Watchdog,
                _ = status_tick.tick() => Wake::Status,
            };
            match wake {
                Wake::Exit(e) => return e,
                Wake::Reload(reply) => {
                    let answer = self.reload().await;
                    if let Some(tx) = reply {
                        let _ = tx.send(answer.map_err(|e| e.into()));
                    }
                }
                Wake::Watchdog => {
                    if let Some(w) = watchdog {
                        self.watchdog(w);
                    }
                }
                Wake::Status => notify(&[NotifyState::Status(&self.status_line())]),
            }
        }
    }

    /// Pings systemd's watchdog only while no worker has spent more than
    /// half of it on one batch: a pipeline stuck in inference stops the
    /// pings and systemd restarts it.
    fn watchdog(&self, w: Duration) {
        let busy = self.generation.scheduler.longest_busy();
        if busy < w / 2 {
            notify(&[NotifyState::Watchdog]);
        } else {
            tracing::error!(
                busy_s = busy.as_secs_f64(),
                "a pipeline is stuck in inference; withholding the watchdog ping"
            );
        }
    }

    /// Reads the config again and switches to it (see `reload.rs`); the
    /// API and the OTA agent see the generation that runs afterwards.
    async fn reload(&mut self) -> Result<(), ReloadError> {
        notify(&[NotifyState::Reloading, NotifyState::Status("reloading")]);
        let next = reload::next_config(&self.opts, &self.cfg);
        let r = reload::switch(&mut self.core, &mut self.generation, &mut self.cfg, next).await;
        self.core.stats.reload(match &r {
            Ok(()) => stats::ReloadOutcome::Applied,
            Err(ReloadError::Start(_)) => stats::ReloadOutcome::RolledBack,
            Err(_) => stats::ReloadOutcome::Refused,
        });
        if r.is_ok() {
            tracing::info!(
                pipelines = self.generation.scheduler.pipelines().len(),
                "reloaded"
            );
        }
        self.current
            .store(Arc::new(self.generation.scheduler.clone()));
        self.ingress
            .store(Arc::new(self.generation.ingress.clone()));
        notify(&[NotifyState::Ready, NotifyState::Status(&self.status_line())]);
        r
    }

    /// Sources stop taking frames, workers finish every queued frame, then
    /// the API, the OTA agent and the uplink stop, and the outbox is
    /// flushed and fsynced.
    async fn stop(mut self) -> Result<(), DaemonError> {
        tracing::info!("stopping: sources first, then the queued frames, then the outbox");
        notify(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
        self.ready.store(false, Ordering::SeqCst);
        // Cameras are sources: they stop first.
        self.core.cameras.stop().await;
        // Nothing takes the per-stream state over: its streams end here and
        // their last events are stored before the outbox closes.
        let stopped = self.generation.stop().await;
        let _ = tokio::task::spawn_blocking(move || stopped.close_streams()).await;
        self.core.lifecycle.stop();
        let _ = self.api.await;
        if let Some(up) = self.uplink {
            let _ = up.task.await;
        }
        if let Some(o) = self.ota {
            let _ = o.task.await;
        }
        let outbox = self.core.outbox.clone();
        tokio::task::spawn_blocking(move || outbox.close())
            .await?
            .map_err(DaemonError::CloseOutbox)?;
        tracing::info!("stopped");
        Ok(())
    }
}
