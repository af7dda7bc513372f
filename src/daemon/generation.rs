//! One config's pipelines as a generation: the models it needs (loaded
//! models whose manifest is unchanged are reused), its pipelines, workers,
//! sources and local outputs; built while the previous generation still
//! serves, started, and stopped (sources first, then every queued frame,
//! then the outputs). Also the record sink the pipelines store through.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::backend::ort::{Runtime, SessionOptions};
use crate::config::Config;
use crate::model::manifest::Manifest;
use crate::model::registry::{LoadedModel, open_model_arg};
use crate::outbox::Outbox;
use crate::output::{OutputConfig, OutputCtx};
use crate::pipeline::realtime::RealtimeStats;
use crate::pipeline::recent::RecentRecords;
use crate::pipeline::{IdGen, Pipeline, RecordSink, ResultRecord, Scheduler};
use crate::source::mqtt::{BrokerAddr, start_embedded_broker};
use crate::source::{FrameError, FrameErrorKind, SourceConfig, SourceCtx};

use super::RunOptions;

/// Records go to the outbox first; printing is for demos; the last few
/// of each pipeline stay in memory for the console.
pub(super) struct OutboxSink {
    pub(super) outbox: Outbox,
    pub(super) print: bool,
    pub(super) recent: Arc<RecentRecords>,
}

fn store_error(e: crate::outbox::OutboxError) -> FrameError {
    let kind = if e.is_transient() {
        FrameErrorKind::Unavailable
    } else {
        FrameErrorKind::Store
    };
    FrameError::new(kind, e.to_string())
}

impl OutboxSink {
    /// What follows a stored record: printing (demos) and the console's recent list.
    fn stored(&self, record: &ResultRecord, bytes: &[u8]) {
        if self.print {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(bytes);
            let _ = out.write_all(b"\n");
            let _ = out.flush();
        }
        self.recent.push(&record.pipeline, bytes);
    }
}

impl RecordSink for OutboxSink {
    fn store(&self, record: &ResultRecord, bytes: &[u8]) -> Result<(), FrameError> {
        self.outbox
            .append(&record.stream, bytes)
            .map_err(store_error)?;
        self.stored(record, bytes);
        Ok(())
    }

    fn store_all(&self, records: &[(ResultRecord, Vec<u8>)]) -> Vec<Result<(), FrameError>> {
        let appended = self.outbox.append_all(
            records
                .iter()
                .map(|(r, j)| (r.stream.as_str(), j.as_slice())),
        );
        records
            .iter()
            .zip(appended)
            .map(|((r, j), a)| {
                a.map_err(store_error)?;
                self.stored(r, j);
                Ok(())
            })
            .collect()
    }
}
/// Everything that lives as long as the process.
pub(super) struct Core {
    pub(super) device: String,
    pub(super) runtime: Arc<Runtime>,
    pub(super) outbox: Outbox,
    pub(super) ids: Arc<IdGen>,
    pub(super) sink: Arc<dyn RecordSink>,
    /// Loaded models by name, with the sha256 their manifest had.
    pub(super) models: HashMap<String, (String, Arc<LoadedModel>)>,
    pub(super) broker_started: Option<std::net::SocketAddr>,
    /// Refused real-time settings (process-wide, across generations).
    pub(super) realtime: Arc<RealtimeStats>,
    /// The daemon's stop: each generation's tokens are its children.
    pub(super) shutdown: CancellationToken,
    /// The descriptors unix output readers share, across generations.
    pub(super) reader_fds: Arc<tokio::sync::Semaphore>,
}

/// One config's pipelines, workers and sources.
pub(super) struct Generation {
    pub(super) scheduler: Scheduler,
    workers: Vec<std::thread::JoinHandle<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Stops the sources.
    stop: CancellationToken,
    /// Local outputs stop after the workers, so the last frames' records reach them.
    outputs: Vec<tokio::task::JoinHandle<()>>,
    outputs_stop: CancellationToken,
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
    pub(super) async fn prepare(
        &mut self,
        cfg: &Config,
    ) -> anyhow::Result<(Prepared, Vec<String>)> {
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
                        start_embedded_broker(&cfg.embedded_broker)?;
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
                reserved_fds: cfg.api.reserved_fds,
            },
            refused,
        ))
    }

    /// Starts a prepared generation's workers and sources.
    pub(super) async fn launch(&self, p: Prepared) -> anyhow::Result<Generation> {
        let Prepared {
            scheduler,
            sources,
            mqtt,
            sched,
            data_dir,
            reserved_fds,
        } = p;
        let worker_handles = scheduler
            .start_workers(&sched, &self.realtime)
            .context("starting inference workers")?;
        // Filled as parts start; on a failure, whatever started is stopped.
        let mut g = Generation {
            scheduler,
            workers: worker_handles,
            tasks: Vec::new(),
            stop: self.shutdown.child_token(),
            outputs: Vec::new(),
            outputs_stop: self.shutdown.child_token(),
            ingress: HashMap::new(),
        };
        // Outputs before sources: a record of the first frame finds them open.
        for p in g.scheduler.pipelines() {
            let ctx = OutputCtx {
                device: self.device.clone(),
                pipeline: p.name().to_string(),
                mqtt: mqtt.clone(),
                shutdown: g.outputs_stop.clone(),
                reserved_fds,
                reader_fds: self.reader_fds.clone(),
            };
            match p.outputs().start(&ctx) {
                Ok(t) => g.outputs.extend(t),
                Err(e) => {
                    g.stop().await;
                    return Err(e.into());
                }
            }
        }
        // Camera sources join their camera; each camera starts once, below.
        let mut cameras = crate::source::camera::CameraSet::default();
        for (i, src) in sources.iter().enumerate() {
            let pipeline = &g.scheduler.pipelines()[i];
            let ctx = SourceCtx {
                pipeline: pipeline.name().to_string(),
                sink: g.scheduler.input(i),
                shutdown: g.stop.clone(),
                mqtt: mqtt.clone(),
                outbox: Some(self.outbox.clone()),
                ids: Some(self.ids.clone()),
                camera: pipeline.stats.camera.clone(),
                data_dir: data_dir.clone(),
            };
            if matches!(src, SourceConfig::Http {}) {
                g.ingress.insert(ctx.pipeline.clone(), ctx.clone());
            }
            ctx.set_state("started");
            if let SourceConfig::Camera(c) = src {
                cameras.add(c, ctx);
                continue;
            }
            match src.build().spawn(ctx) {
                Ok(t) => g.tasks.push(t),
                Err(e) => {
                    // A source that cannot start (address in use) fails the generation.
                    g.stop().await;
                    return Err(e.into());
                }
            }
        }
        match cameras.spawn() {
            Ok(t) => g.tasks.extend(t),
            Err(e) => {
                g.stop().await;
                return Err(e.into());
            }
        }
        Ok(g)
    }
}

/// A generation built but not started.
pub(super) struct Prepared {
    scheduler: Scheduler,
    sources: Vec<SourceConfig>,
    mqtt: Option<BrokerAddr>,
    sched: crate::config::SchedulerConfig,
    data_dir: PathBuf,
    /// `api.reserved_fds`: descriptors unix output readers never take either.
    reserved_fds: u64,
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
        let stop = CancellationToken::new();
        stop.cancel();
        Generation {
            scheduler: Scheduler::new(Vec::new()),
            workers: Vec::new(),
            tasks: Vec::new(),
            stop: stop.clone(),
            outputs: Vec::new(),
            outputs_stop: stop,
            ingress: HashMap::new(),
        }
    }

    /// Stops the sources, then lets the workers finish every queued frame.
    pub(super) async fn stop(self) {
        self.stop.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
        self.scheduler.stop();
        join_workers(self.workers).await;
        self.outputs_stop.cancel();
        for t in self.outputs {
            let _ = t.await;
        }
    }
}
/// Loads the config again and prepares its generation (the old one still runs).
pub(super) async fn reload(
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
