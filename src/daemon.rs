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

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use sd_notify::NotifyState;

use crate::api::metrics::{self as api_metrics, DaemonCollector};
use crate::api::{self, ApiState, Control};
use crate::backend::ort::{Runtime, SessionOptions};
use crate::config::Config;
use crate::model::manifest::Manifest;
use crate::model::registry::{LoadedModel, open_model_arg};
use crate::outbox::Outbox;
use crate::output::{OutputConfig, OutputCtx};
use crate::pipeline::realtime::RealtimeStats;
use crate::pipeline::recent::RecentRecords;
use crate::pipeline::{IdGen, Pipeline, RecordSink, ResultRecord, Scheduler};
use crate::source::http::HttpIngress;
use crate::source::mqtt::{BrokerAddr, start_embedded_broker};
use crate::source::{FrameError, FrameErrorKind, SourceConfig, SourceCtx};
use crate::telemetry::metrics;
use crate::uplink;

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

/// Records go to the outbox first; printing is for demos; the last few
/// of each pipeline stay in memory for the console.
struct OutboxSink {
    outbox: Outbox,
    print: bool,
    recent: Arc<RecentRecords>,
}

impl RecordSink for OutboxSink {
    fn store(&self, record: &ResultRecord, bytes: &[u8]) -> Result<(), FrameError> {
        self.outbox.append(&record.stream, bytes).map_err(|e| {
            let kind = if e.is_transient() {
                FrameErrorKind::Unavailable
            } else {
                FrameErrorKind::Store
            };
            FrameError::new(kind, e.to_string())
        })?;
        if self.print {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(bytes);
            let _ = out.write_all(b"\n");
            let _ = out.flush();
        }
        self.recent.push(&record.pipeline, bytes);
        Ok(())
    }
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
        .any(|p| matches!(p.source, SourceConfig::Camera(_)))
    {
        crate::source::camera::bounded_malloc();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("outpost-io")
        .build()
        .context("tokio runtime")?;
    let restart = rt.block_on(run_async(cfg, opts))?;
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

/// A daemon slot on trial must say READY within `limit`, or it exits and the
/// launcher's boot counter counts a failed start. A thread, not a task: a
/// start stuck loading models must not hold it up.
fn ready_deadline(cfg: &Config) {
    let (Some(ota), Some(slot)) = (&cfg.ota, crate::ota::slots::running_slot()) else {
        return;
    };
    let on_trial = matches!(
        crate::ota::slots::Slots::new(&cfg.data_dir).load(),
        Ok(Some(b)) if b.trying.as_deref() == Some(slot.as_str())
    );
    if !on_trial {
        return;
    }
    let limit = ota.daemon_ready_timeout;
    let _ = std::thread::Builder::new()
        .name("ready-deadline".into())
        .spawn(move || {
            std::thread::sleep(limit);
            if !READY.load(Ordering::SeqCst) {
                tracing::error!(slot = %slot, limit_s = limit.as_secs_f64(), "this daemon slot did not get READY in time; exiting");
                std::process::exit(1);
            }
        });
}

/// Everything that lives as long as the process.
struct Core {
    device: String,
    runtime: Arc<Runtime>,
    outbox: Outbox,
    ids: Arc<IdGen>,
    sink: Arc<dyn RecordSink>,
    /// Loaded models by name, with the sha256 their manifest had.
    models: HashMap<String, (String, Arc<LoadedModel>)>,
    broker_started: Option<std::net::SocketAddr>,
    /// Refused real-time settings (process-wide, across generations).
    realtime: Arc<RealtimeStats>,
}

/// One config's pipelines, workers and sources.
struct Generation {
    scheduler: Scheduler,
    workers: Vec<std::thread::JoinHandle<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    stop: tokio::sync::watch::Sender<bool>,
    /// Local outputs stop after the workers, so the last frames' records reach them.
    outputs: Vec<tokio::task::JoinHandle<()>>,
    outputs_stop: tokio::sync::watch::Sender<bool>,
    ingress: HashMap<String, SourceCtx>,
}

fn session_options(cfg: &Config) -> SessionOptions {
    SessionOptions {
        providers: cfg.runtime.providers.clone(),
        intra_threads: cfg.runtime.intra_threads,
        tensorrt: cfg.runtime.tensorrt.clone(),
        cuda_device_id: cfg.runtime.cuda_device_id,
        cuda: cfg.runtime.cuda.clone(),
        cache_dir: cfg.tensorrt_cache_dir(),
    }
}

/// The sha256 a model's manifest declares now (to tell whether a loaded model is still current).
/// (an OTA update may ship the same file under a new version, so both count).
fn manifest_sha(model_dir: &Path, name: &str) -> Option<String> {
    Manifest::load(&model_dir.join(name).join("manifest.toml"))
        .ok()
        .map(|m| format!("{}@{}", m.sha256, m.version))
}

impl Core {
    /// Loads the models a config's pipelines use, reusing loaded ones whose
    /// manifest checksum is unchanged. Returns the models and the errors.
    async fn models_for(
        &self,
        cfg: &Config,
    ) -> (HashMap<String, (String, Arc<LoadedModel>)>, Vec<String>) {
        let so = session_options(cfg);
        let mut out = HashMap::new();
        let mut refused = Vec::new();
        // Pipeline models and their stages' models.
        let names = cfg
            .pipelines
            .iter()
            .flat_map(|p| std::iter::once(&p.model).chain(p.stages.iter().map(|s| &s.model)));
        for model in names {
            if out.contains_key(model) {
                continue;
            }
            let current = manifest_sha(&cfg.model_dir, model).unwrap_or_default();
            if let Some((sha, m)) = self.models.get(model)
                && *sha == current
            {
                out.insert(model.clone(), (sha.clone(), m.clone()));
                continue;
            }
            let (rt, name, dir, so) = (
                self.runtime.clone(),
                model.clone(),
                cfg.model_dir.clone(),
                so.clone(),
            );
            match tokio::task::spawn_blocking(move || open_model_arg(&rt, &name, &dir, &so)).await {
                Ok(Ok(m)) => {
                    out.insert(model.clone(), (current, Arc::new(m)));
                }
                Ok(Err(e)) => {
                    tracing::error!(model = %model, error = %e, "model refused; its pipelines will not run");
                    refused.push(e.to_string());
                }
                Err(e) => refused.push(format!("model {model}: {e}")),
            }
        }
        (out, refused)
    }

    /// Loads models and builds a config's pipelines (the part that can fail
    /// on a bad model or config), without starting anything.
    async fn prepare(&mut self, cfg: &Config) -> anyhow::Result<(Prepared, Vec<String>)> {
        let (models, mut refused) = self.models_for(cfg).await;
        let workers = cfg.scheduler.worker_count();
        let mut pipelines = Vec::new();
        let mut sources = Vec::new();
        for p in &cfg.pipelines {
            let Some((_, model)) = models.get(&p.model) else {
                continue;
            };
            let Some(stage_models) = p
                .stages
                .iter()
                .map(|s| models.get(&s.model).map(|(_, m)| m.clone()))
                .collect::<Option<Vec<_>>>()
            else {
                continue;
            };
            match Pipeline::new(
                p.clone(),
                model.clone(),
                &cfg.model_dir,
                workers,
                self.sink.clone(),
                self.ids.clone(),
            )
            .and_then(|pl| pl.with_stages(&stage_models))
            {
                Ok(pl) => {
                    sources.push(p.source.clone());
                    pipelines.push(Arc::new(pl));
                }
                Err(e) => {
                    tracing::error!(error = %e, "pipeline not started");
                    refused.push(e.to_string());
                }
            }
        }
        if pipelines.is_empty() && !cfg.pipelines.is_empty() {
            anyhow::bail!("no pipeline could start:\n  {}", refused.join("\n  "));
        }
        self.models = models;

        let mqtt_outputs = pipelines
            .iter()
            .flat_map(|p| &p.cfg.outputs)
            .any(|o| matches!(o, OutputConfig::Mqtt { .. }));
        let mqtt = if mqtt_outputs
            || sources
                .iter()
                .any(|s| matches!(s, SourceConfig::Mqtt { .. }))
        {
            let prefix = format!("outpost-{}", self.device);
            match &cfg.site_broker {
                Some(b) => Some(BrokerAddr {
                    host: b.host.clone(),
                    port: b.port,
                    client_prefix: prefix,
                }),
                None => {
                    let l = cfg.embedded_broker.listen;
                    if self.broker_started.is_none() {
                        start_embedded_broker(&cfg.embedded_broker)
                            .map_err(|e| anyhow::anyhow!(e))?;
                        self.broker_started = Some(l);
                    } else if self.broker_started != Some(l) {
                        tracing::warn!(
                            "embedded_broker.listen changed: it takes effect at the next restart"
                        );
                    }
                    let l = self.broker_started.unwrap_or(l);
                    Some(BrokerAddr {
                        host: l.ip().to_string(),
                        port: l.port(),
                        client_prefix: prefix,
                    })
                }
            }
        } else {
            None
        };
        Ok((
            Prepared {
                scheduler: Scheduler::new(pipelines),
                sources,
                mqtt,
                sched: cfg.scheduler.clone(),
                data_dir: cfg.data_dir.clone(),
            },
            refused,
        ))
    }

    /// Starts a prepared generation's workers and sources.
    async fn launch(&self, p: Prepared) -> anyhow::Result<Generation> {
        let Prepared {
            scheduler,
            sources,
            mqtt,
            sched,
            data_dir,
        } = p;
        let worker_handles = scheduler
            .start_workers(&sched, &self.realtime)
            .context("starting inference workers")?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let (outputs_stop, outputs_rx) = tokio::sync::watch::channel(false);
        let mut ingress = HashMap::new();
        let mut tasks = Vec::new();
        let mut outputs = Vec::new();
        // Outputs before sources: a record of the first frame finds them open.
        for p in scheduler.pipelines() {
            let ctx = OutputCtx {
                device: self.device.clone(),
                pipeline: p.name().to_string(),
                mqtt: mqtt.clone(),
                shutdown: outputs_rx.clone(),
            };
            match p.outputs().start(&ctx) {
                Ok(t) => outputs.extend(t),
                Err(e) => {
                    let g = Generation {
                        scheduler,
                        workers: worker_handles,
                        tasks,
                        stop: stop_tx,
                        outputs,
                        outputs_stop,
                        ingress,
                    };
                    g.stop().await;
                    return Err(e.into());
                }
            }
        }
        for (i, src) in sources.iter().enumerate() {
            let ctx = SourceCtx {
                pipeline: scheduler.pipelines()[i].name().to_string(),
                sink: scheduler.input(i),
                shutdown: stop_rx.clone(),
                mqtt: mqtt.clone(),
                outbox: Some(self.outbox.clone()),
                ids: Some(self.ids.clone()),
                camera: scheduler.pipelines()[i].stats.camera.clone(),
                data_dir: data_dir.clone(),
            };
            if matches!(src, SourceConfig::Http {}) {
                ingress.insert(ctx.pipeline.clone(), ctx.clone());
            }
            ctx.set_state("started");
            match src.build().spawn(ctx) {
                Ok(t) => tasks.push(t),
                Err(e) => {
                    // A source that cannot start (address in use) fails the generation.
                    let g = Generation {
                        scheduler,
                        workers: worker_handles,
                        tasks,
                        stop: stop_tx,
                        outputs,
                        outputs_stop,
                        ingress,
                    };
                    g.stop().await;
                    return Err(e.into());
                }
            }
        }
        Ok(Generation {
            scheduler,
            workers: worker_handles,
            tasks,
            stop: stop_tx,
            outputs,
            outputs_stop,
            ingress,
        })
    }
}

/// A generation built but not started.
struct Prepared {
    scheduler: Scheduler,
    sources: Vec<SourceConfig>,
    mqtt: Option<BrokerAddr>,
    sched: crate::config::SchedulerConfig,
    data_dir: PathBuf,
}

async fn join_workers(workers: Vec<std::thread::JoinHandle<()>>) {
    let _ = tokio::task::spawn_blocking(move || {
        for h in workers {
            let _ = h.join();
        }
    })
    .await;
}

impl Generation {
    /// A generation with nothing in it (between stopping one and starting the next).
    fn empty() -> Generation {
        let (stop, _) = tokio::sync::watch::channel(true);
        let (outputs_stop, _) = tokio::sync::watch::channel(true);
        Generation {
            scheduler: Scheduler::new(Vec::new()),
            workers: Vec::new(),
            tasks: Vec::new(),
            stop,
            outputs: Vec::new(),
            outputs_stop,
            ingress: HashMap::new(),
        }
    }

    /// Stops the sources, then lets the workers finish every queued frame.
    async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        self.scheduler.stop();
        join_workers(self.workers).await;
        let _ = self.outputs_stop.send(true);
        for t in self.outputs {
            let _ = t.await;
        }
    }
}

/// Runs until stopped; true when it stopped to restart into a new daemon slot.
async fn run_async(cfg: Config, opts: RunOptions) -> anyhow::Result<bool> {
    ready_deadline(&cfg);
    let realtime = Arc::new(RealtimeStats::default());
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
    let ids = Arc::new(IdGen::new(device.clone(), outbox.boot()));
    let recent = Arc::new(RecentRecords::default());
    let sink: Arc<dyn RecordSink> = Arc::new(OutboxSink {
        outbox: outbox.clone(),
        print: opts.print_records,
        recent: recent.clone(),
    });
    let mut core = Core {
        device: device.clone(),
        runtime,
        outbox: outbox.clone(),
        ids,
        sink,
        models: HashMap::new(),
        broker_started: None,
        realtime: realtime.clone(),
    };

    notify(&[NotifyState::Status("loading and warming models")]);
    let (prepared, _refused) = core.prepare(&cfg).await?;
    let mut generation = core.launch(prepared).await?;

    // Process-wide: the uplink and the API outlive generations.
    let (global_stop_tx, global_stop_rx) = tokio::sync::watch::channel(false);
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
            let up = uplink::start_with_commands(
                u,
                outbox.clone(),
                &device,
                cmd_tx,
                global_stop_rx.clone(),
            )?;
            extra.push(up.stats.clone());
            Some(up)
        }
        None => None,
    };
    let current = Arc::new(RwLock::new(generation.scheduler.clone()));
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
                global_stop_rx.clone(),
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
    let ingress = Arc::new(RwLock::new(generation.ingress.clone()));
    let conn_stats = Arc::new(api::serve::ConnStats::default());
    extra.push(conn_stats.clone());
    let registry = Arc::new(api_metrics::registry(DaemonCollector {
        scheduler: current.clone(),
        outbox: outbox.clone(),
        extra,
    }));
    let (reload_tx, mut reload_rx) =
        tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<Result<(), String>>>(4);
    let control = Control::from_config(&cfg.api, reload_tx.clone())?;
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
        shutdown: global_stop_rx.clone(),
    };
    let listener = tokio::net::TcpListener::bind(cfg.api.listen)
        .await
        .with_context(|| format!("API listen {}", cfg.api.listen))?;
    let app = api::router(
        state,
        HttpIngress {
            pipelines: ingress.clone(),
            max_body_bytes: cfg.api.max_body_bytes,
            body_read_timeout: cfg.api.body_read_timeout,
        },
    );
    let (cap, nofile) = api::serve::connection_cap(&cfg.api);
    if cap < cfg.api.max_connections {
        tracing::warn!(
            max_connections = cfg.api.max_connections,
            cap,
            nofile = nofile.unwrap_or(0),
            reserved_fds = cfg.api.reserved_fds,
            "API: fewer connections than api.max_connections, to keep descriptors for storage (raise LimitNOFILE)"
        );
    }
    let api_cfg = cfg.api.clone();
    let api_stop = global_stop_rx.clone();
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
    notify(&[
        NotifyState::Ready,
        NotifyState::Status(&status_line(&generation.scheduler)),
    ]);
    tracing::info!(
        device = %device,
        boot = outbox.boot(),
        pipelines = generation.scheduler.pipelines().len(),
        workers = cfg.scheduler.worker_count(),
        api = %cfg.api.listen,
        "outpost ready"
    );

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
        *current.write().unwrap_or_else(|p| p.into_inner()) = generation.scheduler.clone();
        *ingress.write().unwrap_or_else(|p| p.into_inner()) = generation.ingress.clone();
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
    let _ = global_stop_tx.send(true);
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

/// Loads the config again and prepares its generation (the old one still runs).
async fn reload(
    core: &mut Core,
    opts: &RunOptions,
    old: &Config,
) -> anyhow::Result<(Config, Prepared)> {
    let Some(path) = &opts.config_path else {
        anyhow::bail!("no config file to reload");
    };
    let mut cfg = Config::load(path)?;
    if let Some(d) = &opts.model_dir_override {
        cfg.model_dir = d.clone();
    }
    // What lives as long as the process keeps its first value.
    for (what, changed) in [
        ("data_dir", cfg.data_dir != old.data_dir),
        ("device", cfg.device != old.device),
        ("outbox", cfg.outbox != old.outbox),
        ("uplink", cfg.uplink != old.uplink),
        ("api", cfg.api != old.api),
        (
            "runtime.onnxruntime",
            cfg.runtime.onnxruntime != old.runtime.onnxruntime,
        ),
    ] {
        if changed {
            tracing::warn!(
                setting = what,
                "changed in the config: takes effect at the next restart"
            );
        }
    }
    cfg.data_dir = old.data_dir.clone();
    cfg.device = old.device.clone();
    cfg.outbox = old.outbox.clone();
    cfg.uplink = old.uplink.clone();
    cfg.api = old.api.clone();
    cfg.runtime.onnxruntime = old.runtime.onnxruntime.clone();
    let (prepared, _refused) = core.prepare(&cfg).await?;
    Ok((cfg, prepared))
}

/// The daemon as the OTA agent sees it.
pub struct DaemonModelHost {
    pub scheduler: Arc<RwLock<Scheduler>>,
    pub runtime: Arc<Runtime>,
    pub session: SessionOptions,
    pub model_dir: PathBuf,
    pub data_dir: PathBuf,
    pub outbox: Outbox,
    pub ids: Arc<IdGen>,
    pub ready: Arc<AtomicBool>,
    pub restart: tokio::sync::mpsc::Sender<()>,
}

impl DaemonModelHost {
    fn scheduler(&self) -> Scheduler {
        self.scheduler
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl crate::ota::host::ModelHost for DaemonModelHost {
    fn model_dir(&self) -> PathBuf {
        self.model_dir.clone()
    }

    fn data_dir(&self) -> PathBuf {
        self.data_dir.clone()
    }

    fn load(&self, manifest: &Path) -> Result<Arc<LoadedModel>, String> {
        crate::model::registry::load_manifest(&self.runtime, manifest, &self.session)
            .map(Arc::new)
            .map_err(|e| e.to_string())
    }

    fn current(&self, name: &str) -> Option<Arc<LoadedModel>> {
        self.scheduler()
            .pipelines()
            .iter()
            .map(|p| p.model())
            .find(|m| m.manifest.name == name)
    }

    fn swap(&self, model: Arc<LoadedModel>) -> Result<Option<Arc<LoadedModel>>, String> {
        let sched = self.scheduler();
        let users: Vec<_> = sched
            .pipelines()
            .iter()
            .filter(|p| p.model().manifest.name == model.manifest.name)
            .collect();
        let mut previous = None;
        for p in users {
            previous = Some(p.swap_model(model.clone())?);
        }
        Ok(previous)
    }

    fn health(&self, name: &str) -> crate::ota::host::ModelHealth {
        let sched = self.scheduler();
        let mut h = crate::ota::host::ModelHealth::default();
        for p in sched
            .pipelines()
            .iter()
            .filter(|p| p.model().manifest.name == name)
        {
            h.runs += crate::pipeline::PipelineStats::get(&p.stats.batches);
            h.errors += p.stats.drops().get("inference_error").copied().unwrap_or(0);
            let s = p.stats.inference_us.summary();
            if let Some(v) = s.get("p99_us").and_then(|v| v.as_u64()) {
                h.p99_us = Some(h.p99_us.map_or(v, |x| x.max(v)));
            }
        }
        h
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    fn restart(&self) {
        let _ = self.restart.try_send(());
    }

    fn event(&self, stream: &str, event: &serde_json::Value) -> Result<(), String> {
        let (id, seq) = self.ids.next();
        let rec = serde_json::json!({
            "id": id,
            "device": self.ids.device,
            "pipeline": "ota",
            "stream": stream,
            "seq": seq,
            "ts": crate::record::rfc3339(std::time::SystemTime::now()),
            "event": event,
        });
        let bytes = serde_json::to_vec(&rec).map_err(|e| e.to_string())?;
        self.outbox
            .append(stream, &bytes)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}
