//! The daemon: builds everything a config describes, runs it, stops it.
//!
//! Start order: ONNX Runtime -> models (loaded and warmed) -> outbox ->
//! pipelines and workers -> broker -> sources -> API; ready only then.
//! Stop order (SIGTERM, SIGINT): sources stop taking frames, workers finish
//! every queued frame, the outbox is flushed and fsynced, then exit.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;

use crate::api::{self, ApiState};
use crate::backend::ort::{Runtime, SessionOptions};
use crate::config::Config;
use crate::model::registry::{LoadedModel, open_model_arg};
use crate::outbox::Outbox;
use crate::pipeline::{IdGen, Pipeline, RecordSink, ResultRecord, Scheduler};
use crate::source::http::HttpIngress;
use crate::source::mqtt::{BrokerAddr, start_embedded_broker};
use crate::source::{SourceConfig, SourceCtx};
use crate::telemetry::metrics::{self, DaemonCollector};
use crate::uplink;

/// Options of `outpost run` beyond the config.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Print every stored record as one JSON line on stdout.
    pub print_records: bool,
}

/// Records go to the outbox first; printing is for demos.
struct OutboxSink {
    outbox: Outbox,
    print: bool,
}

impl RecordSink for OutboxSink {
    fn store(&self, record: &ResultRecord) -> Result<(), String> {
        let bytes = serde_json::to_vec(record).map_err(|e| e.to_string())?;
        self.outbox
            .append(&record.stream, &bytes)
            .map_err(|e| e.to_string())?;
        if self.print {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(&bytes);
            let _ = out.write_all(b"\n");
            let _ = out.flush();
        }
        Ok(())
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub fn run(cfg: Config, opts: RunOptions) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("outpost-io")
        .build()
        .context("tokio runtime")?;
    rt.block_on(run_async(cfg, opts))
}

async fn run_async(cfg: Config, opts: RunOptions) -> anyhow::Result<()> {
    let device = cfg.device_name();
    let runtime = Runtime::load(cfg.runtime.onnxruntime.as_deref())?;
    let session_opts = SessionOptions {
        providers: cfg.runtime.providers.clone(),
        intra_threads: cfg.runtime.intra_threads,
        tensorrt: cfg.runtime.tensorrt.clone(),
        cuda_device_id: cfg.runtime.cuda_device_id,
        cache_dir: cfg.tensorrt_cache_dir(),
    };
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("data_dir {}", cfg.data_dir.display()))?;

    // Models: each one used by a pipeline, loaded once and shared.
    let mut models: HashMap<String, Arc<LoadedModel>> = HashMap::new();
    let mut refused = Vec::new();
    for p in &cfg.pipelines {
        if models.contains_key(&p.model) {
            continue;
        }
        let (rt2, name, dir, so) = (
            runtime.clone(),
            p.model.clone(),
            cfg.model_dir.clone(),
            session_opts.clone(),
        );
        match tokio::task::spawn_blocking(move || open_model_arg(&rt2, &name, &dir, &so)).await? {
            Ok(m) => {
                models.insert(p.model.clone(), Arc::new(m));
            }
            Err(e) => {
                tracing::error!(model = %p.model, error = %e, "model refused; its pipelines will not run");
                refused.push(e.to_string());
            }
        }
    }

    let outbox_dir = cfg.data_dir.join("outbox");
    let (od, oc) = (outbox_dir.clone(), cfg.outbox.clone());
    let outbox = tokio::task::spawn_blocking(move || Outbox::open(&od, oc))
        .await?
        .with_context(|| format!("outbox {}", outbox_dir.display()))?;
    let ids = Arc::new(IdGen::new(device.clone(), outbox.boot()));
    let sink: Arc<dyn RecordSink> = Arc::new(OutboxSink {
        outbox: outbox.clone(),
        print: opts.print_records,
    });
    let workers = cfg.scheduler.worker_count();

    let mut pipelines = Vec::new();
    let mut sources = Vec::new();
    for p in &cfg.pipelines {
        let Some(model) = models.get(&p.model) else {
            continue;
        };
        match Pipeline::new(
            p.clone(),
            model.clone(),
            &cfg.model_dir,
            workers,
            sink.clone(),
            ids.clone(),
        ) {
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
    let scheduler = Scheduler::new(pipelines);
    let worker_handles = scheduler
        .start_workers(workers)
        .context("starting inference workers")?;

    // The broker mqtt sources connect to.
    let mqtt = if sources
        .iter()
        .any(|s| matches!(s, SourceConfig::Mqtt { .. }))
    {
        match &cfg.site_broker {
            Some(b) => Some(BrokerAddr {
                host: b.host.clone(),
                port: b.port,
                client_prefix: format!("outpost-{device}"),
            }),
            None => {
                start_embedded_broker(&cfg.embedded_broker).map_err(|e| anyhow::anyhow!(e))?;
                let l = cfg.embedded_broker.listen;
                Some(BrokerAddr {
                    host: l.ip().to_string(),
                    port: l.port(),
                    client_prefix: format!("outpost-{device}"),
                })
            }
        }
    } else {
        None
    };

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut ingress = HashMap::new();
    let mut tasks = Vec::new();
    for (i, src) in sources.iter().enumerate() {
        let ctx = SourceCtx {
            pipeline: scheduler.pipelines()[i].name().to_string(),
            index: i,
            scheduler: scheduler.clone(),
            shutdown: stop_rx.clone(),
            mqtt: mqtt.clone(),
            outbox: Some(outbox.clone()),
            data_dir: cfg.data_dir.clone(),
        };
        if matches!(src, SourceConfig::Http {}) {
            ingress.insert(ctx.pipeline.clone(), ctx.clone());
        }
        tasks.push(src.build().spawn(ctx)?);
    }

    let ready = Arc::new(AtomicBool::new(false));
    // The uplink drains the outbox; it starts after the outbox, independent of the pipelines.
    let mut extra: Vec<Arc<dyn metrics::MetricSource>> = Vec::new();
    let uplink = match &cfg.uplink {
        Some(u) => {
            let up = uplink::start(u, outbox.clone(), &device, stop_rx.clone())?;
            extra.push(up.stats.clone());
            Some(up)
        }
        None => None,
    };
    let registry = Arc::new(metrics::registry(DaemonCollector {
        scheduler: scheduler.clone(),
        outbox: outbox.clone(),
        extra,
    }));
    let state = ApiState {
        ready: ready.clone(),
        scheduler: scheduler.clone(),
        outbox: outbox.clone(),
        device: device.clone(),
        boot: outbox.boot(),
        metrics: registry,
    };
    let listener = tokio::net::TcpListener::bind(cfg.api.listen)
        .await
        .with_context(|| format!("API listen {}", cfg.api.listen))?;
    let app = api::router(
        state,
        HttpIngress {
            pipelines: Arc::new(ingress),
        },
    );
    let mut api_stop = stop_rx.clone();
    let api_task = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = api_stop.wait_for(|s| *s).await;
            })
            .await;
    });
    ready.store(true, Ordering::SeqCst);
    tracing::info!(
        device = %device,
        boot = outbox.boot(),
        pipelines = scheduler.pipelines().len(),
        workers,
        api = %cfg.api.listen,
        "outpost ready"
    );

    wait_for_signal().await;
    tracing::info!("stopping: sources first, then the queued frames, then the outbox");
    ready.store(false, Ordering::SeqCst);
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    scheduler.stop();
    tokio::task::spawn_blocking(move || {
        for h in worker_handles {
            let _ = h.join();
        }
    })
    .await?;
    let _ = api_task.await;
    if let Some(up) = uplink {
        let _ = up.task.await;
    }
    tokio::task::spawn_blocking(move || outbox.close())
        .await?
        .context("closing the outbox")?;
    tracing::info!("stopped");
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Exists so `check` can tell whether a config's pipelines could start here.
pub fn model_exists(model_dir: &Path, name: &str) -> bool {
    model_dir.join(name).join("manifest.toml").is_file() || Path::new(name).is_file()
}
