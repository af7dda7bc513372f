//! One config's pipelines as a generation: the models it needs (loaded
//! models whose manifest is unchanged are reused), its pipelines (each fed
//! by the source its config names), workers and local outputs; built while
//! the previous generation still serves, started, and stopped (sources
//! first, then every queued frame, then the outputs).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::ort::{Runtime, SessionOptions};
use crate::config::Config;
use crate::model::manifest::Manifest;
use crate::model::registry::{LoadedModel, ModelError, open_model_arg};
use crate::outbox::Outbox;
use crate::output::{OutputConfig, OutputCtx, OutputError};
use crate::pipeline::realtime::RealtimeStats;
use crate::pipeline::{IdGen, Pipeline, RecordSink, Scheduler};
use crate::record::Events;
use crate::source::mqtt::{BrokerAddr, EmbeddedBrokerError, start_embedded_broker};
use crate::source::{SourceConfig, SourceCtx, SourceError};

use super::lifecycle::{GenerationStop, Lifecycle};
use super::stats::GenerationStats;

/// Why a generation could not be built or started.
#[derive(Debug, thiserror::Error)]
pub enum GenerationError {
    /// Every pipeline was refused (one that starts is enough to serve).
    #[error("no pipeline could start:\n  {}", list(.0))]
    NoPipeline(Vec<Refused>),
    #[error(transparent)]
    Broker(#[from] EmbeddedBrokerError),
    #[error("starting inference workers")]
    Workers(#[source] std::io::Error),
    #[error(transparent)]
    Output(#[from] OutputError),
    /// A source that cannot start (address in use) fails the generation.
    #[error(transparent)]
    Source(#[from] SourceError),
}

/// A model or pipeline left out of a generation (its pipelines do not run).
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("model {model}: {source}")]
    ModelTask {
        model: String,
        source: tokio::task::JoinError,
    },
    /// The pipeline's own error (its config against its model).
    #[error(transparent)]
    Pipeline(Box<dyn std::error::Error + Send + Sync>),
}

fn list(refused: &[Refused]) -> String {
    refused
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join("\n  ")
}

/// The folder of a tracking pipeline's best crops; without one (a budget
/// of 0, or a folder that cannot be made) tracks keep no snapshot.
fn track_snapshots(
    data_dir: &Path,
    pipeline: &str,
    budget: u64,
) -> Option<Arc<crate::track::snapshots::SnapshotStore>> {
    if budget == 0 {
        return None;
    }
    let dir = data_dir.join("tracks").join(pipeline);
    match crate::track::snapshots::SnapshotStore::open(&dir, budget) {
        Ok(s) => Some(Arc::new(s)),
        Err(e) => {
            tracing::warn!(pipeline, dir = %dir.display(), error = %e, "track snapshots not kept");
            None
        }
    }
}

/// Everything that lives as long as the process.
pub(super) struct Core {
    pub(super) device: String,
    pub(super) runtime: Arc<Runtime>,
    pub(super) outbox: Outbox,
    pub(super) ids: Arc<IdGen>,
    pub(super) sink: Arc<dyn RecordSink>,
    /// Status records (cameras, OTA): the same sink as `sink`.
    pub(super) events: Events,
    /// Loaded models by name, with the sha256 their manifest had.
    pub(super) models: HashMap<String, (String, Arc<LoadedModel>)>,
    pub(super) broker_started: Option<std::net::SocketAddr>,
    /// Refused real-time settings (process-wide, across generations).
    pub(super) realtime: Arc<RealtimeStats>,
    /// The daemon's stop: each generation's tokens are its children.
    pub(super) lifecycle: Lifecycle,
    /// The descriptors unix output readers share, across generations.
    pub(super) reader_fds: Arc<tokio::sync::Semaphore>,
    /// Each tracking pipeline's next track number, across generations: a
    /// pipeline rebuilt by a reload goes on counting, so no track id repeats.
    pub(super) track_numbers: HashMap<String, Arc<std::sync::atomic::AtomicU64>>,
    /// The running cameras: a reload keeps those whose definition stayed.
    pub(super) cameras: crate::source::camera::CameraHost,
    /// Reloads and refused models, for `/metrics`.
    pub(super) stats: Arc<GenerationStats>,
    /// The Modbus server (started once) and the sources' PLC connections.
    pub(super) floor: Arc<crate::floor::Floor>,
    /// The servers the site's controllers read results from (OPC UA):
    /// every generation's pipelines feed them.
    pub(super) servers: super::servers::Servers,
}

/// One config's pipelines, workers and sources.
pub(super) struct Generation {
    pub(super) scheduler: Scheduler,
    workers: Vec<std::thread::JoinHandle<()>>,
    /// The sources' tasks.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Local outputs stop after the workers, so the last frames' records reach them.
    outputs: Vec<tokio::task::JoinHandle<()>>,
    stop: GenerationStop,
    /// The pipelines fed over `POST /v1/pipelines/{name}/infer`.
    pub(super) ingress: HashMap<String, SourceCtx>,
}

pub(super) fn session_options(cfg: &Config) -> SessionOptions {
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
    /// manifest checksum is unchanged. Returns the models and the refusals.
    async fn models_for(
        &self,
        cfg: &Config,
    ) -> (HashMap<String, (String, Arc<LoadedModel>)>, Vec<Refused>) {
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
                    self.stats.model_refused();
                    refused.push(e.into());
                }
                Err(source) => {
                    tracing::error!(model = %model, error = %source, "model refused; its pipelines will not run");
                    self.stats.model_refused();
                    refused.push(Refused::ModelTask {
                        model: model.clone(),
                        source,
                    });
                }
            }
        }
        (out, refused)
    }

    /// Loads models and builds a config's pipelines (the part that can fail
    /// on a bad model or config), without starting anything.
    pub(super) async fn prepare(&mut self, cfg: &Config) -> Result<Prepared, GenerationError> {
        let (models, mut refused) = self.models_for(cfg).await;
        let models_refused: Vec<String> = refused.iter().map(|r| r.to_string()).collect();
        let workers = cfg.scheduler.worker_count();
        let mut pipelines = Vec::new();
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
            let built = match &p.track {
                Some(track) => {
                    // The boot is in the id, so the numbers start at 1 each
                    // boot; they are kept across reloads within it.
                    let numbers = self
                        .track_numbers
                        .entry(p.name.clone())
                        .or_insert_with(|| Arc::new(1.into()))
                        .clone();
                    // A pipeline over several cameras: each camera's own
                    // boxes for the console.
                    let cameras: Vec<String> = match &p.source {
                        SourceConfig::Camera(c) if c.is_many() => {
                            c.resolved_many.iter().map(|d| d.name.clone()).collect()
                        }
                        _ => Vec::new(),
                    };
                    let tracking =
                        crate::track::PipelineTracking::new(crate::track::TrackingSetup {
                            track,
                            zones: &p.zones,
                            lines: &p.lines,
                            emit: p.emit,
                            device: &self.device,
                            pipeline: &p.name,
                            boot: self.ids.boot,
                            numbers,
                            model: &model.id(),
                            max_record_bytes: cfg.record_limit(p).bytes(),
                            default_label: "object",
                            snapshots: track_snapshots(
                                &cfg.data_dir,
                                &p.name,
                                track.snapshot_bytes,
                            ),
                            cameras: &cameras,
                        });
                    Pipeline::tracked(
                        p.clone(),
                        model.clone(),
                        &cfg.model_dir,
                        workers,
                        self.sink.clone(),
                        self.ids.clone(),
                        Arc::new(tracking),
                    )
                }
                None => Pipeline::new(
                    p.clone(),
                    model.clone(),
                    &cfg.model_dir,
                    workers,
                    self.sink.clone(),
                    self.ids.clone(),
                ),
            };
            match built.and_then(|pl| pl.with_stages(&stage_models)) {
                Ok(pl) => pipelines.push(Arc::new(pl)),
                Err(e) => {
                    tracing::error!(error = %e, "pipeline not started");
                    refused.push(Refused::Pipeline(Box::new(e)));
                }
            }
        }
        if pipelines.is_empty() && !cfg.pipelines.is_empty() {
            return Err(GenerationError::NoPipeline(refused));
        }
        self.models = models;
        let mqtt = self.mqtt_for(cfg, &pipelines)?;
        Ok(Prepared {
            scheduler: Scheduler::new(pipelines),
            mqtt,
            sched: cfg.scheduler.clone(),
            data_dir: cfg.data_dir.clone(),
            reserved_fds: cfg.api.reserved_fds,
            models_refused,
            modbus_server: cfg.modbus_server.clone(),
        })
    }

    /// The broker the pipelines' mqtt sources and outputs use: the site's,
    /// or the embedded one (started once, on the first config that needs it).
    fn mqtt_for(
        &mut self,
        cfg: &Config,
        pipelines: &[Arc<Pipeline>],
    ) -> Result<Option<BrokerAddr>, GenerationError> {
        let needed = pipelines.iter().any(|p| {
            matches!(p.cfg.source, SourceConfig::Mqtt { .. })
                || p.cfg
                    .outputs
                    .iter()
                    .any(|o| matches!(o, OutputConfig::Mqtt { .. }))
        });
        if !needed {
            return Ok(None);
        }
        let prefix = format!("outpost-{}", self.device);
        if let Some(b) = &cfg.site_broker {
            return Ok(Some(BrokerAddr {
                host: b.host.clone(),
                port: b.port,
                client_prefix: prefix,
            }));
        }
        let l = cfg.embedded_broker.listen;
        if self.broker_started.is_none() {
            start_embedded_broker(&cfg.embedded_broker)?;
            self.broker_started = Some(l);
        } else if self.broker_started != Some(l) {
            tracing::warn!("embedded_broker.listen changed: it takes effect at the next restart");
        }
        let l = self.broker_started.unwrap_or(l);
        Ok(Some(BrokerAddr {
            host: l.ip().to_string(),
            port: l.port(),
            client_prefix: prefix,
        }))
    }

    /// Starts a prepared generation's workers, outputs and sources.
    pub(super) async fn launch(&mut self, p: Prepared) -> Result<Generation, GenerationError> {
        let Prepared {
            scheduler,
            mqtt,
            sched,
            data_dir,
            reserved_fds,
            models_refused: _,
            modbus_server,
        } = p;
        self.floor.reconfigure(modbus_server.as_ref());
        let modbus = self.floor.new_hub();
        let worker_handles = scheduler
            .start_workers(&sched, &self.realtime)
            .map_err(GenerationError::Workers)?;
        // Filled as parts start; on a failure, whatever started is stopped.
        let mut g = Generation {
            scheduler,
            workers: worker_handles,
            tasks: Vec::new(),
            outputs: Vec::new(),
            stop: self.lifecycle.generation(),
            ingress: HashMap::new(),
        };
        // Outputs before sources: a record of the first frame finds them open.
        for p in g.scheduler.pipelines() {
            let ctx = OutputCtx {
                device: self.device.clone(),
                pipeline: p.name().to_string(),
                mqtt: mqtt.clone(),
                shutdown: g.stop.outputs.clone(),
                reserved_fds,
                reader_fds: self.reader_fds.clone(),
                modbus_server: self.floor.server().cloned(),
                taps: self.servers.taps(p.name()),
            };
            match p.outputs().start(&ctx) {
                Ok(t) => g.outputs.extend(t),
                Err(e) => {
                    g.stop().await;
                    return Err(e.into());
                }
            }
        }
        // Each pipeline is fed by the source its own config names; `i` is
        // its place in the scheduler (its queue). Camera sources join their
        // camera; each camera starts once, below.
        let mut cameras = crate::source::camera::CameraSet::default();
        let pipelines = g.scheduler.pipelines().to_vec();
        for (i, pipeline) in pipelines.iter().enumerate() {
            let src = &pipeline.cfg.source;
            let ctx = SourceCtx {
                pipeline: pipeline.name().to_string(),
                sink: g.scheduler.input(i),
                shutdown: g.stop.sources.clone(),
                mqtt: mqtt.clone(),
                outbox: Some(self.outbox.clone()),
                events: Some(self.events.clone()),
                camera: pipeline.stats.camera.clone(),
                data_dir: data_dir.clone(),
                modbus: modbus.clone(),
            };
            if matches!(src, SourceConfig::Http {}) {
                g.ingress.insert(ctx.pipeline.clone(), ctx.clone());
            }
            ctx.set_state("started");
            if let SourceConfig::Camera(c) = src {
                if c.is_many() {
                    // Each camera feeds the pipeline through its own way
                    // in (its drops are its own) with its own state.
                    for (k, def) in c.resolved_many.iter().enumerate() {
                        let mut cam = ctx.clone();
                        cam.sink = g.scheduler.camera_input(i, k);
                        cam.camera = pipeline.stats.cameras.0.get(k).map(|f| f.state.clone());
                        cameras.add_camera(c, def, cam);
                    }
                } else {
                    cameras.add(c, ctx);
                }
                continue;
            }
            match src.build().spawn(ctx) {
                Ok(t) => g.tasks.push(t),
                Err(e) => {
                    g.stop().await;
                    return Err(e.into());
                }
            }
        }
        // Cameras that ran for the previous generation as they are now
        // defined go on running (their sessions and decoders kept).
        if let Err(e) = self.cameras.attach(cameras, &self.lifecycle.part()).await {
            self.cameras.park();
            g.stop().await;
            return Err(e.into());
        }
        Ok(g)
    }
}

/// A generation built but not started.
pub(super) struct Prepared {
    scheduler: Scheduler,
    mqtt: Option<BrokerAddr>,
    sched: crate::config::SchedulerConfig,
    data_dir: PathBuf,
    /// `api.reserved_fds`: descriptors unix output readers never take either.
    reserved_fds: u64,
    /// The models that could not be loaded, each with its reason (their
    /// pipelines are left out; a reload refuses such a generation).
    pub(super) models_refused: Vec<String>,
    /// `[modbus_server]`: its map and allow list are the generation's.
    modbus_server: Option<crate::floor::ModbusServerConfig>,
}

impl Prepared {
    /// Per-stream hook state of the stopped generation's unchanged pipelines
    /// carries over; the others' streams end.
    pub(super) fn adopt_streams(&self, old: &Scheduler) {
        self.scheduler.adopt_streams(old);
    }
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
    pub(super) fn empty() -> Generation {
        Generation {
            scheduler: Scheduler::new(Vec::new()),
            workers: Vec::new(),
            tasks: Vec::new(),
            outputs: Vec::new(),
            stop: GenerationStop::stopped(),
            ingress: HashMap::new(),
        }
    }

    /// Stops the sources, then lets the workers finish every queued frame,
    /// then stops the local outputs. Gives back the stopped scheduler, whose
    /// per-stream hook state the next generation may take over.
    pub(super) async fn stop(self) -> Scheduler {
        self.stop.sources.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
        self.scheduler.stop();
        join_workers(self.workers).await;
        self.stop.outputs.cancel();
        for t in self.outputs {
            let _ = t.await;
        }
        self.scheduler
    }
}
