//! The daemon: builds everything a config describes, runs it, reloads it,
//! stops it.
//!
//! Start order: ONNX Runtime -> models (loaded and warmed) -> outbox ->
//! uplink -> pipelines and workers -> broker -> sources -> API; then READY
//! to systemd, and `/readyz` answers 200.
//!
//! Reload (SIGHUP or `POST /v1/reload`): the new config is loaded and
//! checked, its models loaded (unchanged ones are reused) and its pipelines
//! built while the old ones keep serving; only then the old sources stop,
//! the old workers finish every frame they took in, and the new generation
//! starts. The outbox and the uplink are not touched, so nothing stored or
//! in flight is lost. A config that fails to load leaves the old one running.
//!
//! Stop (SIGTERM, SIGINT): sources stop taking frames, workers finish every
//! queued frame, the uplink stops, the outbox is flushed and fsynced.
//!
//! Watchdog: when systemd sets WATCHDOG_USEC, the daemon pings at a third of
//! it, but only while no worker has spent more than half of it on one batch:
//! a pipeline stuck in inference stops the pings and systemd restarts it.
//!
//! Rooms: this file starts and stops the process-wide parts (outbox,
//! uplink, OTA agent, API) and runs the signal loop; `generation.rs` loads
//! models and builds, starts, stops and reloads one config's pipelines;
//! `model_host.rs` is the daemon as the OTA agent sees it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;
use std::time::Duration;

use anyhow::Context;
use sd_notify::NotifyState;
use tokio_util::sync::CancellationToken;

use crate::api::metrics::{self as api_metrics, DaemonCollector};
use crate::api::{self, ApiState, Control};
use crate::backend::ort::Runtime;
use crate::config::Config;
use crate::outbox::Outbox;
use crate::pipeline::realtime::RealtimeStats;
use crate::pipeline::recent::RecentRecords;
use crate::pipeline::{IdGen, RecordSink, Scheduler};
use crate::source::http::HttpIngress;
use crate::telemetry::metrics;
use crate::uplink;

mod generation;
mod model_host;

use generation::{Core, Generation, OutboxSink, reload, session_options};
pub use model_host::DaemonModelHost;

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
pub fn run(cfg: Config, opts: RunOptions) -> anyhow::Result<()> {
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
    let rt = builder.build().context("tokio runtime")?;
    let restart = rt.block_on(run_async(cfg, opts, realtime))?;
    drop(rt);
    if restart {
        tracing::info!(
            code = crate::ota::slots::RESTART_EXIT,
            "exiting so the service manager starts the new daemon slot"
        );
        std::process::exit(crate::ota::slots::RESTART_EXIT);
    }
    Ok(())
}
/// Set once the daemon said READY (read by a new slot's start deadline).
static READY: AtomicBool = AtomicBool::new(false);

/// Runs until stopped; true when it stopped to restart into a new daemon slot.
async fn run_async(
    cfg: Config,
    opts: RunOptions,
    realtime: Arc<RealtimeStats>,
) -> anyhow::Result<bool> {
    if let Some(ota) = &cfg.ota {
        crate::ota::slots::ready_deadline(&cfg.data_dir, ota.daemon_ready_timeout, &READY);
    }
    if cfg.scheduler.lock_memory {
        crate::pipeline::realtime::lock_memory(&realtime);
    }
    let device = cfg.device_name();
    let runtime = Runtime::load(cfg.runtime.onnxruntime.as_deref())?;
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("data_dir {}", cfg.data_dir.display()))?;
    notify(&[NotifyState::Status("opening the outbox")]);
    let outbox_dir = cfg.data_dir.join("outbox");
    let (od, oc) = (outbox_dir.clone(), cfg.outbox.clone());
    let outbox = tokio::task::spawn_blocking(move || Outbox::open(&od, oc))
        .await?
        .with_context(|| format!("outbox {}", outbox_dir.display()))?;
    // Process-wide: the API, the OTA agent and every generation stop with it
    // (a generation's tokens are its children). Whatever way this function
    // returns, the guard cancels it.
    let shutdown = CancellationToken::new();
    let _stop_on_return = shutdown.clone().drop_guard();
    let ids = Arc::new(IdGen::new(device.clone(), outbox.boot()));
    // Before any record is made; saves the clock's state when dropped.
    let _clock = crate::clock::start(&cfg.clock, &cfg.data_dir, ids.clone(), outbox.clone());
    let recent = Arc::new(RecentRecords::default());
    let sink: Arc<dyn RecordSink> = Arc::new(OutboxSink {
        outbox: outbox.clone(),
        print: opts.print_records,
        recent: recent.clone(),
    });
    // Unix output readers draw on the process's descriptors like the API's
    // connections: they get a budget of their own, and the API's cap
    // (below) leaves room for it.
    let readers_asked: u64 = cfg
        .pipelines
        .iter()
        .flat_map(|p| &p.outputs)
        .map(|o| o.max_readers() as u64)
        .sum();
    let reader_fds = crate::output::reader_fd_budget(readers_asked, cfg.api.reserved_fds);
    if reader_fds < readers_asked {
        tracing::warn!(
            max_readers = readers_asked,
            descriptors = reader_fds,
            reserved_fds = cfg.api.reserved_fds,
            "unix outputs: fewer readers than their max_readers, to keep descriptors for storage and the API (raise LimitNOFILE)"
        );
    }
    let mut core = Core {
        device: device.clone(),
        runtime,
        outbox: outbox.clone(),
        ids,
        sink,
        models: HashMap::new(),
        broker_started: None,
        realtime: realtime.clone(),
        shutdown: shutdown.clone(),
        reader_fds: Arc::new(tokio::sync::Semaphore::new(reader_fds as usize)),
    };

    notify(&[NotifyState::Status("loading and warming models")]);
    let (prepared, _refused) = core.prepare(&cfg).await?;
    let mut generation = core.launch(prepared).await?;

    // The uplink outlives generations and stops last; its interface takes a
    // watch, which turns true when `shutdown` is cancelled.
    let (uplink_stop, uplink_stop_rx) = tokio::sync::watch::channel(false);
    let mut extra: Vec<Arc<dyn metrics::MetricSource>> = vec![realtime.clone()];
    let (cmd_tx, cmd_rx) = match (&cfg.ota, cfg.command_topic()) {
        (Some(_), Some(_)) => {
            let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
            (Some(tx), Some(rx))
        }
        _ => (None, None),
    };
    let uplink = match &cfg.uplink {
        Some(u) => {
            let up =
                uplink::start_with_commands(u, outbox.clone(), &device, cmd_tx, uplink_stop_rx)?;
            extra.push(up.stats.clone());
            Some(up)
        }
        None => None,
    };
    let current = Arc::new(ArcSwap::from_pointee(generation.scheduler.clone()));
    let ready = Arc::new(AtomicBool::new(false));
    let (restart_tx, mut restart_rx) = tokio::sync::mpsc::channel::<()>(1);
    let ota = match &cfg.ota {
        Some(o) => {
            let host: Arc<dyn crate::ota::host::ModelHost> = Arc::new(DaemonModelHost {
                scheduler: current.clone(),
                runtime: core.runtime.clone(),
                session: session_options(&cfg),
                model_dir: cfg.model_dir.clone(),
                data_dir: cfg.data_dir.clone(),
                outbox: outbox.clone(),
                ids: core.ids.clone(),
                ready: ready.clone(),
                restart: restart_tx.clone(),
            });
            let agent = crate::ota::start(
                o,
                host,
                &device,
                cfg.device_groups(),
                cmd_rx,
                shutdown.clone(),
            )?;
            extra.push(agent.stats.clone());
            Some(agent)
        }
        None => None,
    };
    let daemon_info = match &ota {
        Some(a) => a
            .stats
            .daemon
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
        None => (
            env!("CARGO_PKG_VERSION").to_string(),
            crate::ota::slots::running_slot().unwrap_or_else(|| "package".into()),
        ),
    };
    let ingress = Arc::new(ArcSwap::from_pointee(generation.ingress.clone()));
    let conn_stats = Arc::new(api::serve::ConnStats::default());
    extra.push(conn_stats.clone());
    let guard_stats = Arc::new(api::guard::GuardStats::default());
    extra.push(guard_stats.clone());
    let registry = Arc::new(api_metrics::registry(DaemonCollector {
        scheduler: current.clone(),
        outbox: outbox.clone(),
        extra,
    }));
    let (reload_tx, mut reload_rx) =
        tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<Result<(), String>>>(4);
    let control = Control::from_config(&cfg.api, reload_tx.clone())?;
    let token = control.token();
    let state = ApiState {
        ready: ready.clone(),
        scheduler: current.clone(),
        outbox: outbox.clone(),
        device: device.clone(),
        boot: outbox.boot(),
        metrics: registry,
        control,
        daemon: daemon_info,
        uplink: uplink.as_ref().map(|u| u.stats.clone()),
        ota: ota.as_ref().map(|o| o.stats.clone()),
        recent,
        shutdown: shutdown.clone(),
    };
    let listener = tokio::net::TcpListener::bind(cfg.api.listen)
        .await
        .with_context(|| format!("API listen {}", cfg.api.listen))?;
    // The address bound (port 0 in the config: the one the system chose).
    let api_addr = listener.local_addr().unwrap_or(cfg.api.listen);
    let app = api::router(
        state,
        HttpIngress {
            pipelines: ingress.clone(),
            max_body_bytes: cfg.api.max_body_bytes,
            body_read_timeout: cfg.api.body_read_timeout,
        },
        Arc::new(api::guard::Guard::new(
            &cfg.api.allowed_hosts,
            api_addr,
            token,
            guard_stats,
        )),
    );
    // The readers' budget comes out of the API's room, so together they
    // never reach the descriptors kept for storage.
    let mut fds = cfg.api.clone();
    fds.reserved_fds = fds.reserved_fds.saturating_add(reader_fds);
    let (cap, nofile) = api::serve::connection_cap(&fds);
    if cap < cfg.api.max_connections {
        tracing::warn!(
            max_connections = cfg.api.max_connections,
            cap,
            nofile = nofile.unwrap_or(0),
            reserved_fds = cfg.api.reserved_fds,
            unix_output_readers = reader_fds,
            "API: fewer connections than api.max_connections, to keep descriptors for storage and unix output readers (raise LimitNOFILE)"
        );
    }
    let api_cfg = cfg.api.clone();
    let api_stop = shutdown.clone();
    let api_task = tokio::spawn(async move {
        api::serve::serve(listener, app, &api_cfg, cap, conn_stats, api_stop).await;
    });

    ready.store(true, Ordering::SeqCst);
    READY.store(true, Ordering::SeqCst);
    let status_line = |s: &Scheduler| {
        format!(
            "serving {} pipeline(s); outbox {} record(s)",
            s.pipelines().len(),
            outbox.stats().records
        )
    };
    // Logged before systemd hears READY: whoever waits on READY finds the
    // bound API address in the log.
    tracing::info!(
        device = %device,
        boot = outbox.boot(),
        pipelines = generation.scheduler.pipelines().len(),
        workers = cfg.scheduler.worker_count(),
        api = %api_addr,
        "outpost ready"
    );
    notify(&[
        NotifyState::Ready,
        NotifyState::Status(&status_line(&generation.scheduler)),
    ]);

    let watchdog = sd_notify::watchdog_enabled();
    let ping_every = watchdog.map(|w| w / 3).unwrap_or(Duration::from_secs(10));
    let mut tick = tokio::time::interval(ping_every);
    let mut status_tick = tokio::time::interval(Duration::from_secs(10));
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let mut hup = signal(SignalKind::hangup()).context("SIGHUP handler")?;
    let mut cfg = cfg;
    let mut restart = false;
    loop {
        let reply = tokio::select! {
            _ = term.recv() => break,
            Some(()) = restart_rx.recv() => {
                restart = true;
                break;
            }
            _ = int.recv() => break,
            _ = hup.recv() => None,
            r = reload_rx.recv() => match r { Some(tx) => Some(tx), None => continue },
            _ = tick.tick() => {
                if let Some(w) = watchdog {
                    let busy = generation.scheduler.longest_busy();
                    if busy < w / 2 {
                        notify(&[NotifyState::Watchdog]);
                    } else {
                        tracing::error!(busy_s = busy.as_secs_f64(), "a pipeline is stuck in inference; withholding the watchdog ping");
                    }
                }
                continue;
            }
            _ = status_tick.tick() => {
                notify(&[NotifyState::Status(&status_line(&generation.scheduler))]);
                continue;
            }
        };
        // Reload.
        notify(&[NotifyState::Reloading, NotifyState::Status("reloading")]);
        let answer = match reload(&mut core, &opts, &cfg).await {
            Ok((new_cfg, prepared)) => {
                // The new pipelines are built and their models warm; now the old
                // sources stop, the old workers finish what they hold, and the
                // new generation takes over the addresses.
                let old = std::mem::replace(&mut generation, Generation::empty());
                old.stop().await;
                match core.launch(prepared).await {
                    Ok(g) => {
                        generation = g;
                        cfg = new_cfg;
                        tracing::info!(
                            pipelines = generation.scheduler.pipelines().len(),
                            "reloaded"
                        );
                        Ok(())
                    }
                    Err(e) => {
                        tracing::error!(error = %format!("{e:#}"), "new config failed to start; restoring the previous one");
                        let restored = match core.prepare(&cfg).await {
                            Ok((p, _)) => core.launch(p).await,
                            Err(e) => Err(e),
                        };
                        match restored {
                            Ok(g) => generation = g,
                            Err(e2) => {
                                tracing::error!(error = %format!("{e2:#}"), "previous config failed to restart")
                            }
                        }
                        Err(format!("{e:#}"))
                    }
                }
            }
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "reload failed; the previous config keeps running");
                Err(format!("{e:#}"))
            }
        };
        current.store(Arc::new(generation.scheduler.clone()));
        ingress.store(Arc::new(generation.ingress.clone()));
        notify(&[
            NotifyState::Ready,
            NotifyState::Status(&status_line(&generation.scheduler)),
        ]);
        if let Some(tx) = reply {
            let _ = tx.send(answer);
        }
    }

    tracing::info!("stopping: sources first, then the queued frames, then the outbox");
    notify(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
    ready.store(false, Ordering::SeqCst);
    generation.stop().await;
    shutdown.cancel();
    let _ = uplink_stop.send(true);
    let _ = api_task.await;
    if let Some(up) = uplink {
        let _ = up.task.await;
    }
    if let Some(o) = ota {
        let _ = o.task.await;
    }
    tokio::task::spawn_blocking(move || outbox.close())
        .await?
        .context("closing the outbox")?;
    tracing::info!("stopped");
    Ok(restart)
}
