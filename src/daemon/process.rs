//! The process-wide parts, started once: ONNX Runtime, the outbox and the
//! sink every record goes through, the first generation, the uplink, the
//! OTA agent, the API and the signal handlers. Each takes its stop from the
//! [`Lifecycle`](super::lifecycle::Lifecycle) tree.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use arc_swap::ArcSwap;
use sd_notify::NotifyState;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::{mpsc, oneshot};

use crate::api::metrics::{self as api_metrics, DaemonCollector};
use crate::api::{self, ApiState, Control};
use crate::backend::ort::Runtime;
use crate::config::Config;
use crate::ota::OtaAgent;
use crate::outbox::Outbox;
use crate::pipeline::realtime::RealtimeStats;
use crate::pipeline::recent::RecentRecords;
use crate::pipeline::{IdGen, Scheduler};
use crate::record::Events;
use crate::source::SourceCtx;
use crate::source::http::HttpIngress;
use crate::telemetry::metrics::MetricSource;
use crate::uplink::{self, Uplink};

use super::error::DaemonError;
use super::generation::{Core, Generation, session_options};
use super::lifecycle::Lifecycle;
use super::model_host::DaemonModelHost;
use super::servers::Servers;
use super::sink::OutboxSink;
use super::{RunOptions, notify};

/// Where the answer to one `POST /v1/reload` goes.
pub(super) type ReloadReply = oneshot::Sender<crate::api::ReloadAnswer>;

/// A running daemon: the current config and generation and the parts that
/// outlive generations.
pub(super) struct Daemon {
    pub(super) opts: RunOptions,
    pub(super) cfg: Config,
    pub(super) core: Core,
    pub(super) generation: Generation,
    /// The current generation as the API, the metrics and the OTA agent see it.
    pub(super) current: Arc<ArcSwap<Scheduler>>,
    pub(super) ingress: Arc<ArcSwap<HashMap<String, SourceCtx>>>,
    /// READY: `/readyz` and the OTA agent's trial read it (set at READY,
    /// cleared when stopping). The only place readiness is kept.
    pub(super) ready: Arc<AtomicBool>,
    pub(super) uplink: Option<Uplink>,
    pub(super) ota: Option<OtaAgent>,
    pub(super) api: tokio::task::JoinHandle<()>,
    pub(super) api_addr: SocketAddr,
    /// `POST /v1/reload`.
    pub(super) reloads: mpsc::Receiver<ReloadReply>,
    /// The OTA agent asks for a restart into a new daemon slot.
    pub(super) restarts: mpsc::Receiver<()>,
    pub(super) signals: Signals,
    /// The clock's watcher; saves the last known good time when dropped.
    pub(super) _clock: crate::clock::ClockTask,
}

/// SIGTERM and SIGINT stop, SIGHUP reloads.
pub(super) struct Signals {
    pub(super) term: Signal,
    pub(super) int: Signal,
    pub(super) hup: Signal,
}

impl Signals {
    fn new() -> Result<Signals, DaemonError> {
        let handler =
            |kind, what| signal(kind).map_err(|source| DaemonError::Signal { what, source });
        Ok(Signals {
            term: handler(SignalKind::terminate(), "SIGTERM")?,
            int: handler(SignalKind::interrupt(), "SIGINT")?,
            hup: handler(SignalKind::hangup(), "SIGHUP")?,
        })
    }
}

/// Unix output readers draw on the process's descriptors like the API's
/// connections: they get a budget of their own, and the API's cap leaves
/// room for it.
fn reader_budget(cfg: &Config) -> u64 {
    let asked: u64 = cfg
        .pipelines
        .iter()
        .flat_map(|p| &p.outputs)
        .map(|o| o.max_readers() as u64)
        .sum();
    let budget = crate::output::reader_fd_budget(asked, cfg.api.reserved_fds);
    if budget < asked {
        tracing::warn!(
            max_readers = asked,
            descriptors = budget,
            reserved_fds = cfg.api.reserved_fds,
            "unix outputs: fewer readers than their max_readers, to keep descriptors for storage and the API (raise LimitNOFILE)"
        );
    }
    budget
}

impl Daemon {
    /// Starts everything a config describes, up to (not including) READY.
    pub(super) async fn start(
        cfg: Config,
        opts: RunOptions,
        realtime: Arc<RealtimeStats>,
    ) -> Result<Daemon, DaemonError> {
        let device = cfg.device_name();
        let runtime = Runtime::load(cfg.runtime.onnxruntime.as_deref())?;
        std::fs::create_dir_all(&cfg.data_dir).map_err(|source| DaemonError::DataDir {
            path: cfg.data_dir.clone(),
            source,
        })?;
        notify(&[NotifyState::Status("opening the outbox")]);
        let outbox_dir = cfg.data_dir.join("outbox");
        let (od, oc) = (outbox_dir.clone(), cfg.outbox.clone());
        let outbox = tokio::task::spawn_blocking(move || Outbox::open(&od, oc))
            .await?
            .map_err(|source| DaemonError::Outbox {
                path: outbox_dir.clone(),
                source,
            })?;
        // Whatever way this function or the daemon returns, dropping the
        // lifecycle stops what had started.
        let lifecycle = Lifecycle::new();
        let ids = Arc::new(IdGen::new(device.clone(), outbox.boot()));
        // Before any record is made.
        let clock = crate::clock::start(&cfg.clock, &cfg.data_dir, ids.clone(), outbox.clone());
        let recent = Arc::new(RecentRecords::default());
        // One sink for results and for the cameras' and OTA's events.
        let sink = Arc::new(OutboxSink {
            outbox: outbox.clone(),
            print: opts.print_records,
            recent: recent.clone(),
        });
        let reader_fds = reader_budget(&cfg);
        // The Modbus server lives as long as the process (a reload swaps
        // its map); records of the first generation find it listening.
        let floor = Arc::new(crate::floor::Floor::start(
            cfg.modbus_server.as_ref(),
            lifecycle.part(),
        )?);
        let mut core = Core {
            device: device.clone(),
            runtime,
            outbox: outbox.clone(),
            ids: ids.clone(),
            sink: sink.clone(),
            events: Events {
                ids,
                sink,
                stamp: crate::clock::stamp_parts,
            },
            models: HashMap::new(),
            broker_started: None,
            realtime: realtime.clone(),
            lifecycle,
            reader_fds: Arc::new(tokio::sync::Semaphore::new(reader_fds as usize)),
            track_numbers: HashMap::new(),
            cameras: Default::default(),
            stats: Default::default(),
            floor: floor.clone(),
            servers: Default::default(),
        };
        // Before the first generation, whose pipelines feed it.
        core.servers = Servers::start(&cfg, &device, core.lifecycle.part()).await?;

        notify(&[NotifyState::Status("loading and warming models")]);
        let prepared = core.prepare(&cfg).await?;
        let generation = core.launch(prepared).await?;

        let mut extra: Vec<Arc<dyn MetricSource>> =
            vec![realtime, core.stats.clone(), floor.clone()];
        extra.extend(core.servers.metrics());
        let (cmd_tx, cmd_rx) = match (&cfg.ota, cfg.command_topic()) {
            (Some(_), Some(_)) => {
                let (tx, rx) = mpsc::channel::<Vec<u8>>(16);
                (Some(tx), Some(rx))
            }
            _ => (None, None),
        };
        // The uplink outlives generations and stops last.
        let uplink = match &cfg.uplink {
            Some(u) => {
                let up = uplink::start_with_commands(
                    u,
                    outbox.clone(),
                    &device,
                    cmd_tx,
                    core.lifecycle.part(),
                )?;
                extra.push(up.stats.clone());
                Some(up)
            }
            None => None,
        };
        let current = Arc::new(ArcSwap::from_pointee(generation.scheduler.clone()));
        let ready = Arc::new(AtomicBool::new(false));
        let (restart_tx, restarts) = mpsc::channel::<()>(1);
        let ota = match &cfg.ota {
            Some(o) => {
                let host: Arc<dyn crate::ota::host::ModelHost> = Arc::new(DaemonModelHost {
                    scheduler: current.clone(),
                    runtime: core.runtime.clone(),
                    session: session_options(&cfg),
                    model_dir: cfg.model_dir.clone(),
                    data_dir: cfg.data_dir.clone(),
                    events: core.events.clone(),
                    ready: ready.clone(),
                    restart: restart_tx,
                });
                let agent = crate::ota::start(
                    o,
                    host,
                    &device,
                    cfg.device_groups(),
                    cmd_rx,
                    core.lifecycle.part(),
                )?;
                extra.push(agent.stats.clone());
                Some(agent)
            }
            None => None,
        };
        let daemon_info = match &ota {
            Some(a) => a.stats.daemon.lock().clone(),
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
        let (reload_tx, reloads) = mpsc::channel::<ReloadReply>(4);
        let control = Control::from_config(&cfg.api, reload_tx)?;
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
            shutdown: core.lifecycle.part(),
            floor,
            opcua: core.servers.opcua_status(),
        };
        let listener = tokio::net::TcpListener::bind(cfg.api.listen)
            .await
            .map_err(|source| DaemonError::Listen {
                addr: cfg.api.listen,
                source,
            })?;
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
        let api_stop = core.lifecycle.part();
        let api = tokio::spawn(async move {
            api::serve::serve(listener, app, &api_cfg, cap, conn_stats, api_stop).await;
        });
        // Before READY: a SIGHUP right after it must reload, not kill.
        let signals = Signals::new()?;
        Ok(Daemon {
            opts,
            cfg,
            core,
            generation,
            current,
            ingress,
            ready,
            uplink,
            ota,
            api,
            api_addr,
            reloads,
            restarts,
            signals,
            _clock: clock,
        })
    }
}
