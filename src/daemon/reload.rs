//! Reload (SIGHUP or `POST /v1/reload`): read the config again, keep the
//! settings that need a restart, build the new generation while the old one
//! serves, switch, and fall back to the previous config when the new one
//! fails to start.
//!
//! The decision is [`switch`], written against [`Generations`] so that it
//! is tested with a fake (below) as well as run by the daemon's [`Core`].

use std::path::PathBuf;

use crate::config::{ApiConfig, Config, ConfigError, DeviceConfig};
use crate::outbox::OutboxConfig;
use crate::uplink::UplinkConfig;

use super::RunOptions;
use super::generation::{Core, Generation, GenerationError, Prepared};

/// Why a reload did not switch to the new config.
#[derive(Debug, thiserror::Error)]
pub(super) enum ReloadError {
    #[error("no config file to reload")]
    NoConfigFile,
    /// The file does not read or validate; the old config keeps running.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The new generation could not be built (models, pipelines, the
    /// embedded broker); the old one never stopped.
    #[error(transparent)]
    Build(GenerationError),
    /// A model the new config names could not be loaded (its manifest,
    /// file, declared sizes or warm-up): the old generation, whose models
    /// all loaded, keeps serving rather than one without that model's
    /// pipelines.
    #[error(
        "the new config's models could not all be loaded; the running generation keeps serving:\n  {}",
        .0.join("\n  ")
    )]
    Models(Vec<String>),
    /// Built, but it failed to start once the old one had stopped; the
    /// previous config was started again.
    #[error(transparent)]
    Start(GenerationError),
}

/// An error and its causes on one line, `outer: inner: ...` (what the log
/// and the API's answer to a reload show).
pub(super) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// The settings that need a restart: the parts built from them (the
/// outbox, the uplink, the API, ONNX Runtime, the device's name in ids)
/// live as long as the process. A reload keeps their first value and warns
/// for each one the file changed.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct RestartOnly {
    data_dir: PathBuf,
    device: Option<DeviceConfig>,
    outbox: OutboxConfig,
    uplink: Option<UplinkConfig>,
    api: ApiConfig,
    onnxruntime: Option<PathBuf>,
}

impl RestartOnly {
    pub(super) fn of(cfg: &Config) -> RestartOnly {
        RestartOnly {
            data_dir: cfg.data_dir.clone(),
            device: cfg.device.clone(),
            outbox: cfg.outbox.clone(),
            uplink: cfg.uplink.clone(),
            api: cfg.api.clone(),
            onnxruntime: cfg.runtime.onnxruntime.clone(),
        }
    }

    /// The config keys whose values differ in `other`, in this order.
    pub(super) fn changed(&self, other: &RestartOnly) -> Vec<&'static str> {
        // Destructured, so a setting added to the group is compared too.
        let RestartOnly {
            data_dir,
            device,
            outbox,
            uplink,
            api,
            onnxruntime,
        } = self;
        [
            ("data_dir", *data_dir != other.data_dir),
            ("device", *device != other.device),
            ("outbox", *outbox != other.outbox),
            ("uplink", *uplink != other.uplink),
            ("api", *api != other.api),
            ("runtime.onnxruntime", *onnxruntime != other.onnxruntime),
        ]
        .into_iter()
        .filter_map(|(key, changed)| changed.then_some(key))
        .collect()
    }

    /// Writes these values into `cfg`.
    pub(super) fn restore(self, cfg: &mut Config) {
        let RestartOnly {
            data_dir,
            device,
            outbox,
            uplink,
            api,
            onnxruntime,
        } = self;
        cfg.data_dir = data_dir;
        cfg.device = device;
        cfg.outbox = outbox;
        cfg.uplink = uplink;
        cfg.api = api;
        cfg.runtime.onnxruntime = onnxruntime;
    }
}

/// Reads the config file again, with the model directory the command line
/// gave and the restart-only settings of the running config.
pub(super) fn next_config(opts: &RunOptions, running: &Config) -> Result<Config, ReloadError> {
    let path = opts.config_path.as_ref().ok_or(ReloadError::NoConfigFile)?;
    let mut cfg = Config::load(path)?;
    if let Some(d) = &opts.model_dir_override {
        cfg.model_dir = d.clone();
    }
    let kept = RestartOnly::of(running);
    for setting in kept.changed(&RestartOnly::of(&cfg)) {
        tracing::warn!(
            setting,
            "changed in the config: takes effect at the next restart"
        );
    }
    kept.restore(&mut cfg);
    Ok(cfg)
}

/// The steps a reload takes on generations.
pub(super) trait Generations {
    /// A generation built (models loaded and warm) but not started.
    type Built;
    type Running;
    /// What a stopped generation leaves for the next (per-stream state).
    type Stopped;
    async fn build(&mut self, cfg: &Config) -> Result<Self::Built, GenerationError>;
    async fn start(&mut self, built: Self::Built) -> Result<Self::Running, GenerationError>;
    /// Sources first, then every queued frame, then the outputs.
    async fn stop(&mut self, running: Self::Running) -> Self::Stopped;
    /// A built generation takes over what the stopped one left (per-stream
    /// state of the pipelines whose config did not change).
    fn adopt(&mut self, built: &Self::Built, stopped: &Self::Stopped);
    /// The models a built generation could not load, each with its reason.
    fn models_refused(&self, built: &Self::Built) -> Vec<String>;
    /// Nothing running.
    fn none(&self) -> Self::Running;
}

/// A reload once the next config is known (or why there is none):
/// - no config, or its generation cannot be built, or one of its models
///   cannot be loaded: the old generation keeps running, untouched;
/// - built: the old generation stops, the new one starts (the addresses
///   its sources bind are free only then);
/// - the new one fails to start: the previous config is built and started
///   again; when that fails too, nothing runs (logged).
///
/// Afterwards `running` and `cfg` are what runs.
pub(super) async fn switch<G: Generations>(
    g: &mut G,
    running: &mut G::Running,
    cfg: &mut Config,
    next: Result<Config, ReloadError>,
) -> Result<(), ReloadError> {
    let built = match next {
        Ok(new) => match g.build(&new).await {
            Ok(b) => match g.models_refused(&b) {
                refused if refused.is_empty() => Ok((new, b)),
                refused => Err(ReloadError::Models(refused)),
            },
            Err(e) => Err(ReloadError::Build(e)),
        },
        Err(e) => Err(e),
    };
    let (new, built) = match built {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %chain(&e), "reload failed; the previous config keeps running");
            return Err(e);
        }
    };
    let old = std::mem::replace(running, g.none());
    let stopped = g.stop(old).await;
    g.adopt(&built, &stopped);
    match g.start(built).await {
        Ok(r) => {
            *running = r;
            *cfg = new;
            Ok(())
        }
        Err(e) => {
            tracing::error!(error = %chain(&e), "new config failed to start; restoring the previous one");
            let restored = match g.build(cfg).await {
                Ok(b) => g.start(b).await,
                Err(e) => Err(e),
            };
            match restored {
                Ok(r) => *running = r,
                Err(e2) => {
                    tracing::error!(error = %chain(&e2), "previous config failed to restart")
                }
            }
            Err(ReloadError::Start(e))
        }
    }
}

impl Generations for Core {
    type Built = Prepared;
    type Running = Generation;
    type Stopped = crate::pipeline::Scheduler;

    async fn build(&mut self, cfg: &Config) -> Result<Prepared, GenerationError> {
        self.prepare(cfg).await
    }

    async fn start(&mut self, built: Prepared) -> Result<Generation, GenerationError> {
        self.launch(built).await
    }

    async fn stop(&mut self, running: Generation) -> crate::pipeline::Scheduler {
        // Cameras run on for the next generation, handing frames to no one.
        self.cameras.park();
        running.stop().await
    }

    fn adopt(&mut self, built: &Prepared, stopped: &crate::pipeline::Scheduler) {
        built.adopt_streams(stopped);
    }

    fn models_refused(&self, built: &Prepared) -> Vec<String> {
        built.models_refused.clone()
    }

    fn none(&self) -> Generation {
        Generation::empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn config(text: &str) -> Config {
        Config::from_toml(text, "test.toml", |_| None).unwrap()
    }

    /// Generations named by their config's model_dir; the names in
    /// `fail_build` / `fail_start` fail that step.
    #[derive(Default)]
    struct Fake {
        fail_build: HashSet<&'static str>,
        fail_start: HashSet<&'static str>,
        /// Built, but one of their models was refused.
        refuse_models: HashSet<&'static str>,
        steps: Vec<String>,
    }

    fn refusal() -> GenerationError {
        GenerationError::NoPipeline(Vec::new())
    }

    impl Generations for Fake {
        type Built = String;
        type Running = String;
        type Stopped = ();

        async fn build(&mut self, cfg: &Config) -> Result<String, GenerationError> {
            let name = cfg.model_dir.display().to_string();
            self.steps.push(format!("build {name}"));
            if self.fail_build.contains(name.as_str()) {
                return Err(refusal());
            }
            Ok(name)
        }

        async fn start(&mut self, built: String) -> Result<String, GenerationError> {
            self.steps.push(format!("start {built}"));
            if self.fail_start.contains(built.as_str()) {
                return Err(refusal());
            }
            Ok(built)
        }

        async fn stop(&mut self, running: String) {
            self.steps.push(format!("stop {running}"));
        }

        fn adopt(&mut self, _built: &String, _stopped: &()) {}

        fn models_refused(&self, built: &String) -> Vec<String> {
            if self.refuse_models.contains(built.as_str()) {
                vec![format!("model of {built} refused")]
            } else {
                Vec::new()
            }
        }

        fn none(&self) -> String {
            "none".into()
        }
    }

    /// Runs one reload from "old" to `next`; returns what runs after it,
    /// the running config's model_dir, the steps and the result.
    fn reload(
        mut fake: Fake,
        next: Result<Config, ReloadError>,
    ) -> (String, String, Vec<String>, Result<(), ReloadError>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut running = "old".to_string();
        let mut cfg = config("model_dir = \"old\"");
        let r = rt.block_on(switch(&mut fake, &mut running, &mut cfg, next));
        (running, cfg.model_dir.display().to_string(), fake.steps, r)
    }

    fn new() -> Result<Config, ReloadError> {
        Ok(config("model_dir = \"new\""))
    }

    #[test]
    fn a_good_config_stops_the_old_generation_then_starts_the_new() {
        let (running, cfg, steps, r) = reload(Fake::default(), new());
        assert!(r.is_ok());
        assert_eq!((running.as_str(), cfg.as_str()), ("new", "new"));
        assert_eq!(steps, ["build new", "stop old", "start new"]);
    }

    #[test]
    fn a_config_that_does_not_read_leaves_the_old_generation_untouched() {
        let (running, cfg, steps, r) = reload(Fake::default(), Err(ReloadError::NoConfigFile));
        assert!(matches!(r, Err(ReloadError::NoConfigFile)));
        assert_eq!((running.as_str(), cfg.as_str()), ("old", "old"));
        assert!(steps.is_empty(), "{steps:?}");
    }

    #[test]
    fn a_generation_that_cannot_be_built_never_stops_the_old_one() {
        let fake = Fake {
            fail_build: HashSet::from(["new"]),
            ..Fake::default()
        };
        let (running, cfg, steps, r) = reload(fake, new());
        assert!(matches!(r, Err(ReloadError::Build(_))), "{r:?}");
        assert_eq!((running.as_str(), cfg.as_str()), ("old", "old"));
        assert_eq!(steps, ["build new"]);
    }

    #[test]
    fn a_model_the_new_config_cannot_load_keeps_the_old_generation() {
        let fake = Fake {
            refuse_models: HashSet::from(["new"]),
            ..Fake::default()
        };
        let (running, cfg, steps, r) = reload(fake, new());
        assert!(
            matches!(&r, Err(ReloadError::Models(m)) if m == &["model of new refused"]),
            "{r:?}"
        );
        assert_eq!((running.as_str(), cfg.as_str()), ("old", "old"));
        assert_eq!(steps, ["build new"]);
    }

    #[test]
    fn a_generation_that_fails_to_start_falls_back_to_the_previous_config() {
        let fake = Fake {
            fail_start: HashSet::from(["new"]),
            ..Fake::default()
        };
        let (running, cfg, steps, r) = reload(fake, new());
        assert!(matches!(r, Err(ReloadError::Start(_))), "{r:?}");
        assert_eq!((running.as_str(), cfg.as_str()), ("old", "old"));
        assert_eq!(
            steps,
            [
                "build new",
                "stop old",
                "start new",
                "build old",
                "start old"
            ]
        );
    }

    #[test]
    fn when_the_previous_config_fails_to_restart_too_nothing_runs() {
        let fake = Fake {
            fail_start: HashSet::from(["new", "old"]),
            ..Fake::default()
        };
        let (running, cfg, steps, r) = reload(fake, new());
        assert!(matches!(r, Err(ReloadError::Start(_))), "{r:?}");
        assert_eq!((running.as_str(), cfg.as_str()), ("none", "old"));
        assert_eq!(steps.len(), 5, "{steps:?}");
    }

    #[test]
    fn restart_only_settings_are_compared_and_restored_as_one_group() {
        let old = config(
            r#"
data_dir = "/var/lib/a"
device = "gw-1"
[api]
listen = "127.0.0.1:9100"
"#,
        );
        // (Any file that exists: the config checks the library is there.)
        let library = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let mut new = config(&format!(
            r#"
data_dir = "/var/lib/b"
device = "gw-2"
model_dir = "/models/new"
[api]
listen = "127.0.0.1:9200"
[runtime]
onnxruntime = "{library}"
[outbox]
flush_records = 7
"#
        ));
        let kept = RestartOnly::of(&old);
        assert_eq!(kept.changed(&RestartOnly::of(&old)), Vec::<&str>::new());
        assert_eq!(
            kept.changed(&RestartOnly::of(&new)),
            ["data_dir", "device", "outbox", "api", "runtime.onnxruntime"]
        );
        kept.clone().restore(&mut new);
        assert_eq!(RestartOnly::of(&new), kept);
        // What a reload may change is left as the file has it.
        assert_eq!(new.model_dir, PathBuf::from("/models/new"));
    }

    #[test]
    fn the_next_config_keeps_restart_only_settings_and_the_command_line_model_dir() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("outpost.toml");
        std::fs::write(&path, "data_dir = \"/elsewhere\"\nmodel_dir = \"m\"\n").unwrap();
        let running = config("data_dir = \"/var/lib/outpost\"");
        let mut opts = RunOptions {
            config_path: Some(path.clone()),
            ..RunOptions::default()
        };
        let cfg = next_config(&opts, &running).unwrap();
        assert_eq!(cfg.data_dir, PathBuf::from("/var/lib/outpost"));
        assert_eq!(cfg.model_dir, PathBuf::from("m"));
        opts.model_dir_override = Some(PathBuf::from("/cli/models"));
        let cfg = next_config(&opts, &running).unwrap();
        assert_eq!(cfg.model_dir, PathBuf::from("/cli/models"));
        // A file that does not read is a typed error, its text the whole chain.
        std::fs::write(&path, "[[pipelinez]]\n").unwrap();
        let e = next_config(&opts, &running).unwrap_err();
        assert!(matches!(e, ReloadError::Config(_)), "{e:?}");
        assert!(chain(&e).contains("test.toml") || chain(&e).contains("outpost.toml"));
        let none = RunOptions::default();
        assert!(matches!(
            next_config(&none, &running),
            Err(ReloadError::NoConfigFile)
        ));
    }

    #[test]
    fn chain_joins_the_causes_like_the_log_always_showed_them() {
        let e = GenerationError::Workers(std::io::Error::other("no threads"));
        assert_eq!(chain(&e), "starting inference workers: no threads");
        let e = ReloadError::Start(e);
        assert_eq!(chain(&e), "starting inference workers: no threads");
    }
}
