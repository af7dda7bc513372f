//! The running server: endpoints and certificate from the config, one
//! folder per pipeline under Objects with its variables, and the task that
//! takes each pipeline's latest record from its slot into the variables
//! (which notifies the subscriptions that watch them).
//!
//! The server lives as long as the daemon: a reload keeps its sessions and
//! subscriptions; a pipeline the new config adds gets its folder then, and
//! the variables of a removed one stay with their last value.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use opcua::crypto::{CertificateStore, SecurityPolicy, X509};
use opcua::server::address_space::{AddressSpace, NodeType, Variable};
use opcua::server::diagnostics::NamespaceMetadata;
use opcua::server::node_manager::memory::{SimpleNodeManager, simple_node_manager};
use opcua::server::{ServerBuilder, ServerEndpoint, ServerHandle, SubscriptionCache};
use opcua::types::{
    AttributeId, DataValue, DateTime, MessageSecurityMode, NodeId, ObjectId, StatusCode,
    TimestampsToReturn, VariableId, Variant,
};
use parking_lot::Mutex;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::auth::{Auth, AuthStats, Secret, User, thumbprint};
use crate::config::{ListenUrl, OpcuaConfig, Security, read_password_file};
use crate::feed::{Feed, Slots};
use crate::values::{self, Var};

/// Why the server could not start (none of these is helped by retrying
/// with the same config and machine).
#[derive(Debug, thiserror::Error)]
pub enum OpcuaError {
    #[error("opcua.listen: {0}")]
    Listen(String),
    #[error("opcua.listen: cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("opcua.users[{index}]: {detail}")]
    User { index: usize, detail: String },
    #[error("opcua.pki_dir: {dir}: {detail}")]
    Pki { dir: PathBuf, detail: String },
    #[error("opcua.trusted_clients: {dir}: {source}")]
    Trusted {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("opcua: the server could not be built: {0}")]
    Build(String),
}

/// What the server needs from the daemon.
pub struct ServerCtx {
    /// The device name: the namespace is `urn:outpost:<device>`.
    pub device: String,
    /// Default parent of the pki folder (`<data_dir>/opcua/pki`).
    pub data_dir: PathBuf,
    /// The host name endpoints are described with when `listen` is a
    /// wildcard address.
    pub hostname: String,
    /// outpost's version, in the server's build info.
    pub version: String,
    /// Cancelled when the daemon stops.
    pub shutdown: CancellationToken,
}

/// Counters of the server.
#[derive(Default)]
pub struct Stats {
    pub(crate) auth: Arc<AuthStats>,
    /// Records taken into the variables.
    records: AtomicU64,
    /// Data change notifications queued to clients' monitored items.
    notifications: AtomicU64,
    /// Fields a record gave no value for, by reason.
    no_value: Mutex<std::collections::BTreeMap<&'static str, u64>>,
    /// Records that were not JSON objects (never expected).
    bad_records: AtomicU64,
}

/// `[opcua]` in `/v1/status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpcuaStatus {
    pub listen: String,
    pub namespace: String,
    pub security: Vec<&'static str>,
    pub anonymous: bool,
    /// Sessions open now.
    pub sessions: u32,
    /// Sessions made since the start.
    pub sessions_total: u32,
    pub logins: u64,
    pub logins_refused: std::collections::BTreeMap<&'static str, u64>,
    pub records: u64,
    /// Records replaced in their slot before the server took them.
    pub superseded: u64,
    pub notifications: u64,
    pub values_missing: std::collections::BTreeMap<&'static str, u64>,
    pub variables: usize,
}

/// One pipeline as the server sees it.
struct PipelineVars {
    folder: NodeId,
    record: NodeId,
    vars: Vec<(Var, NodeId)>,
    /// No mapped field: its top-level numbers are added as they appear.
    auto: bool,
}

/// The running server, shared by the daemon.
pub struct Opcua {
    handle: ServerHandle,
    nm: Arc<SimpleNodeManager>,
    ns: u16,
    cfg: OpcuaConfig,
    slots: Arc<Slots>,
    pipelines: Mutex<HashMap<String, PipelineVars>>,
    stats: Stats,
    addr: SocketAddr,
    namespace: String,
}

fn policy(s: Security) -> (SecurityPolicy, MessageSecurityMode) {
    use MessageSecurityMode::{None as Plain, Sign, SignAndEncrypt};
    match s {
        Security::None => (SecurityPolicy::None, Plain),
        Security::Basic256sha256Sign => (SecurityPolicy::Basic256Sha256, Sign),
        Security::Basic256sha256SignEncrypt => (SecurityPolicy::Basic256Sha256, SignAndEncrypt),
        Security::Aes128sha256rsaoaepSign => (SecurityPolicy::Aes128Sha256RsaOaep, Sign),
        Security::Aes128sha256rsaoaepSignEncrypt => {
            (SecurityPolicy::Aes128Sha256RsaOaep, SignAndEncrypt)
        }
        Security::Aes256sha256rsapssSign => (SecurityPolicy::Aes256Sha256RsaPss, Sign),
        Security::Aes256sha256rsapssSignEncrypt => {
            (SecurityPolicy::Aes256Sha256RsaPss, SignAndEncrypt)
        }
    }
}

/// The users with their secrets read (environment, files, certificates).
fn users(cfg: &OpcuaConfig) -> Result<Vec<User>, OpcuaError> {
    cfg.users
        .iter()
        .enumerate()
        .map(|(index, u)| {
            let err = |detail: String| OpcuaError::User { index, detail };
            let secret = if let Some(e) = &u.password_env {
                let p = std::env::var(e)
                    .map_err(|_| err(format!("the environment variable `{e}` is not set")))?;
                Secret::Password(p)
            } else if let Some(f) = &u.password_file {
                Secret::Password(read_password_file(f).map_err(|e| err(e.to_string()))?)
            } else if let Some(c) = &u.certificate {
                Secret::Certificate(thumbprint(c).map_err(|e| err(e.to_string()))?)
            } else {
                return Err(err(
                    "set one of password_env, password_file or certificate".into()
                ));
            };
            Ok(User {
                name: u.user.clone(),
                secret,
            })
        })
        .collect()
}

/// Trusts the certificates of `from`: each one is written into
/// `<pki>/trusted/` under the name the store looks it up by (its common
/// name and thumbprint), and taken out of `<pki>/rejected/` (where a
/// certificate refused before would keep it untrusted).
fn trust(from: &Path, pki: &Path) -> Result<usize, OpcuaError> {
    let err = |source| OpcuaError::Trusted {
        dir: from.to_path_buf(),
        source,
    };
    let to = pki.join("trusted");
    std::fs::create_dir_all(&to).map_err(err)?;
    let mut n = 0;
    for e in std::fs::read_dir(from).map_err(err)? {
        let p = e.map_err(err)?.path();
        let ext = p.extension().and_then(|x| x.to_str()).unwrap_or("");
        if !["der", "pem", "crt"].contains(&ext) || !p.is_file() {
            continue;
        }
        let bytes = std::fs::read(&p).map_err(err)?;
        let cert = if bytes.starts_with(b"-----BEGIN") {
            X509::from_pem(&bytes)
        } else {
            X509::from_der(&bytes)
        };
        let Ok(der) = cert.and_then(|c| c.to_der().map(|d| (c, d))) else {
            tracing::warn!(file = %p.display(), "opcua.trusted_clients: not an X.509 certificate, skipped");
            continue;
        };
        let (cert, der) = der;
        let name = CertificateStore::cert_file_name(&cert);
        std::fs::write(to.join(&name), &der).map_err(err)?;
        match std::fs::remove_file(pki.join("rejected").join(&name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
            _ => {}
        }
        n += 1;
    }
    Ok(n)
}

/// The device's private key readable by its owner only (the store writes
/// it with the process's umask).
fn lock_private_key(pki: &Path) -> Result<(), OpcuaError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |e: std::io::Error| OpcuaError::Pki {
        dir: pki.to_path_buf(),
        detail: format!("private key: {e}"),
    };
    let dir = pki.join("private");
    if !dir.exists() {
        return Ok(());
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(err)?;
    for e in std::fs::read_dir(&dir).map_err(err)? {
        let p = e.map_err(err)?.path();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    Ok(())
}

impl Opcua {
    /// Builds the server and starts it on the daemon's runtime; the
    /// returned task ends when `ctx.shutdown` is cancelled.
    pub async fn start(
        cfg: &OpcuaConfig,
        ctx: ServerCtx,
    ) -> Result<(Arc<Opcua>, tokio::task::JoinHandle<()>), OpcuaError> {
        let url = ListenUrl::parse(&cfg.listen).map_err(|e| OpcuaError::Listen(e.to_string()))?;
        let users = users(cfg)?;
        let pki = cfg
            .pki_dir
            .clone()
            .unwrap_or_else(|| ctx.data_dir.join("opcua").join("pki"));
        std::fs::create_dir_all(&pki).map_err(|e| OpcuaError::Pki {
            dir: pki.clone(),
            detail: e.to_string(),
        })?;
        if let Some(t) = &cfg.trusted_clients {
            let n = trust(t, &pki)?;
            tracing::info!(from = %t.display(), certificates = n, "opcua: trusted client certificates");
        }
        // Bound here, so port 0 works and the address is known at once.
        let host = if url.host == "localhost" {
            "127.0.0.1"
        } else {
            &url.host
        };
        let bind = format!(
            "{}:{}",
            if host.contains(':') {
                format!("[{host}]")
            } else {
                host.to_string()
            },
            url.port
        );
        let listener = tokio::net::TcpListener::bind(&bind)
            .await
            .map_err(|source| OpcuaError::Bind {
                addr: bind.clone(),
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| OpcuaError::Bind {
            addr: bind.clone(),
            source,
        })?;
        let described = if addr.ip().is_unspecified() {
            ctx.hostname.clone()
        } else {
            url.host.clone()
        };

        let namespace = format!("urn:outpost:{}", ctx.device);
        let stats = Stats::default();
        let auth = Arc::new(Auth {
            anonymous: cfg.anonymous,
            users,
            stats: stats.auth.clone(),
        });
        let interval_ms = cfg.min_publishing_interval.as_secs_f64() * 1000.0;
        let mut b = ServerBuilder::new()
            .application_name(format!("outpost {}", ctx.device))
            .application_uri(format!("urn:outpost:{}:server", ctx.device))
            .product_uri("urn:outpost")
            .build_info(opcua::types::BuildInfo {
                product_uri: "urn:outpost".into(),
                manufacturer_name: "outpost".into(),
                product_name: "outpost".into(),
                software_version: ctx.version.clone().into(),
                build_number: ctx.version.clone().into(),
                build_date: DateTime::now(),
            })
            .with_node_manager(simple_node_manager(
                NamespaceMetadata {
                    namespace_uri: namespace.clone(),
                    ..Default::default()
                },
                "outpost",
            ))
            .with_authenticator(auth)
            .pki_dir(&pki)
            // The device's own certificate and key, made on first start
            // (self-signed, for its application URI and host names).
            .create_sample_keypair(true)
            .host(described)
            .port(addr.port())
            .discovery_urls(vec![url.path.clone()])
            .max_sessions(cfg.max_sessions)
            .diagnostics_enabled(true)
            .subscription_poll_interval_ms(
                u64::try_from(cfg.min_publishing_interval.as_millis())
                    .unwrap_or(1)
                    .max(1),
            )
            .token(ctx.shutdown.child_token());
        {
            let subs = &mut b.limits_mut().subscriptions;
            subs.min_publishing_interval_ms = interval_ms;
            // Sampling interval 0: a value set from a record is queued to
            // every monitored item at once (a non-zero one holds back a
            // value that follows another within it, by source timestamp).
            subs.min_sampling_interval_ms = 0.0;
        }
        for s in &cfg.security {
            let (p, m) = policy(*s);
            let mut e = ServerEndpoint::new(url.path.as_str(), p, m, &[]);
            if cfg.anonymous {
                e.user_token_ids
                    .insert(opcua::server::ANONYMOUS_USER_TOKEN_ID.to_string());
            }
            b = b.add_endpoint(s.name(), e);
        }
        let (server, handle) = b.build().map_err(OpcuaError::Build)?;
        lock_private_key(&pki)?;
        let secure = cfg.security.iter().any(|s| *s != Security::None);
        if secure && handle.info().server_certificate.is_none() {
            return Err(OpcuaError::Pki {
                dir: pki,
                detail: "the server's certificate and key could neither be read nor made (see the log above)".into(),
            });
        }
        let nm = handle
            .node_managers()
            .get_of_type::<SimpleNodeManager>()
            .ok_or_else(|| OpcuaError::Build("the outpost node manager is missing".into()))?;
        let ns = handle
            .get_namespace_index(&namespace)
            .ok_or_else(|| OpcuaError::Build(format!("namespace {namespace} is missing")))?;
        let me = Arc::new(Opcua {
            handle,
            nm,
            ns,
            cfg: cfg.clone(),
            slots: Arc::default(),
            pipelines: Mutex::default(),
            stats,
            addr,
            namespace,
        });
        tracing::info!(
            listen = %addr,
            namespace = %me.namespace,
            security = ?cfg.security.iter().map(|s| s.name()).collect::<Vec<_>>(),
            anonymous = cfg.anonymous,
            pki = %pki.display(),
            "opcua server listening"
        );
        let run = server.run_with(listener);
        let updater = me.clone();
        let stop = ctx.shutdown.clone();
        let task = tokio::spawn(async move {
            let serve = tokio::spawn(async move {
                if let Err(e) = run.await {
                    tracing::error!(error = %e, "opcua server stopped");
                }
            });
            updater.update_loop(stop).await;
            let _ = serve.await;
        });
        Ok((me, task))
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The feed of `pipeline`: its folder and variables are made now (on
    /// the first call for that name), its records go through the feed.
    pub fn feed(&self, pipeline: &str) -> Feed {
        let mut pl = self.pipelines.lock();
        if !pl.contains_key(pipeline) {
            let mapped = values::mapped(&self.cfg, pipeline);
            let folder = NodeId::new(self.ns, pipeline.to_string());
            let record = NodeId::new(self.ns, values::record_name(pipeline));
            let mut space = self.nm.address_space().write();
            space.add_folder(
                &folder,
                pipeline,
                pipeline,
                &NodeId::from(ObjectId::ObjectsFolder),
            );
            let mut rec = Variable::new(&record, "record", "record", Variant::String("".into()));
            rec.set_data_value(waiting());
            space.add_variables(vec![rec], &folder);
            let vars = mapped
                .into_iter()
                .map(|v| {
                    let id = add_var(&mut space, self.ns, &folder, &v);
                    (v, id)
                })
                .collect::<Vec<_>>();
            pl.insert(
                pipeline.to_string(),
                PipelineVars {
                    folder,
                    record,
                    auto: vars.is_empty(),
                    vars,
                },
            );
        }
        Feed::new(self.slots.clone(), pipeline)
    }

    /// Takes each pipeline's latest record into its variables, as records
    /// arrive, until `stop`.
    async fn update_loop(&self, stop: CancellationToken) {
        let mut buf = Vec::new();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.slots.wake.notified() => {}
            }
            let slots: Vec<_> = self
                .slots
                .by_pipeline
                .lock()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            for (name, slot) in slots {
                if slot.take(&mut buf) {
                    self.apply(&name, &buf);
                }
            }
        }
    }

    /// One record into its pipeline's variables.
    fn apply(&self, pipeline: &str, json: &[u8]) {
        let rec: Value = match serde_json::from_slice(json) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                self.stats.bad_records.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        let now = DateTime::now();
        let stamp = rec
            .get("ts")
            .and_then(Value::as_str)
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .unwrap_or(now);
        let outputs = rec.get("outputs").unwrap_or(&Value::Null);
        let mut pl = self.pipelines.lock();
        let Some(p) = pl.get_mut(pipeline) else {
            return;
        };
        let subs: &SubscriptionCache = self.handle.subscriptions();
        let mut space = self.nm.address_space().write();
        if p.auto {
            let known: Vec<Var> = p.vars.iter().map(|(v, _)| v.clone()).collect();
            for v in values::new_top_level(pipeline, outputs, &known) {
                let id = add_var(&mut space, self.ns, &p.folder, &v);
                p.vars.push((v, id));
            }
        }
        let mut updates: Vec<(&NodeId, DataValue)> = Vec::with_capacity(p.vars.len() + 1);
        let text = String::from_utf8_lossy(json).into_owned();
        updates.push((&p.record, good(Variant::String(text.into()), stamp, now)));
        for (v, id) in &p.vars {
            let dv = match values::value_of(v, outputs) {
                Ok(x) => good(x, stamp, now),
                Err(why) => {
                    *self.stats.no_value.lock().entry(why.label()).or_default() += 1;
                    DataValue {
                        // Empty, not None: a variable without a value
                        // reads as Good, its status dropped.
                        value: Some(Variant::Empty),
                        status: Some(why.status()),
                        source_timestamp: Some(stamp),
                        server_timestamp: Some(now),
                        ..Default::default()
                    }
                }
            };
            updates.push((id, dv));
        }
        for (id, dv) in &updates {
            if let Some(NodeType::Variable(var)) = space.find_mut(*id) {
                var.set_data_value(dv.clone());
            }
        }
        let sent = std::cell::Cell::new(0u64);
        subs.maybe_notify(
            updates.iter().map(|(id, _)| (*id, AttributeId::Value)),
            |id, attr, range, enc| {
                let dv = space.find(id)?.as_node().get_attribute(
                    TimestampsToReturn::Both,
                    attr,
                    range,
                    enc,
                )?;
                sent.set(sent.get() + 1);
                Some(dv)
            },
        );
        self.stats
            .notifications
            .fetch_add(sent.get(), Ordering::Relaxed);
        self.stats.records.fetch_add(1, Ordering::Relaxed);
    }

    fn diagnostic(&self, id: VariableId) -> u32 {
        match self.handle.info().diagnostics.get(id).and_then(|d| d.value) {
            Some(Variant::UInt32(n)) => n,
            _ => 0,
        }
    }

    /// The server's part of `/v1/status` (and of the metrics).
    pub fn status(&self) -> OpcuaStatus {
        let superseded = self
            .slots
            .by_pipeline
            .lock()
            .values()
            .map(|slot| slot.superseded.load(Ordering::Relaxed))
            .sum();
        OpcuaStatus {
            listen: format!("opc.tcp://{}", self.addr),
            namespace: self.namespace.clone(),
            security: self.cfg.security.iter().map(|s| s.name()).collect(),
            anonymous: self.cfg.anonymous,
            sessions: self.diagnostic(
                VariableId::Server_ServerDiagnostics_ServerDiagnosticsSummary_CurrentSessionCount,
            ),
            sessions_total: self.diagnostic(
                VariableId::Server_ServerDiagnostics_ServerDiagnosticsSummary_CumulatedSessionCount,
            ),
            logins: self.stats.auth.accepted(),
            logins_refused: self.stats.auth.refused(),
            records: self.stats.records.load(Ordering::Relaxed),
            superseded,
            notifications: self.stats.notifications.load(Ordering::Relaxed),
            values_missing: self.stats.no_value.lock().clone(),
            variables: self
                .pipelines
                .lock()
                .values()
                .map(|p| p.vars.len() + 1)
                .sum(),
        }
    }
}

fn good(v: Variant, source: DateTime, server: DateTime) -> DataValue {
    DataValue {
        value: Some(v),
        status: Some(StatusCode::Good),
        source_timestamp: Some(source),
        server_timestamp: Some(server),
        ..Default::default()
    }
}

/// What a variable reads before its first record.
fn waiting() -> DataValue {
    DataValue {
        value: Some(Variant::Empty),
        status: Some(StatusCode::BadWaitingForInitialData),
        server_timestamp: Some(DateTime::now()),
        ..Default::default()
    }
}

fn add_var(space: &mut AddressSpace, ns: u16, folder: &NodeId, v: &Var) -> NodeId {
    let id = NodeId::new(ns, v.id.clone());
    let name = v.pointer.trim_start_matches('/');
    let mut var = Variable::new(&id, name, name, values::initial(v.kind));
    var.set_data_type(values::data_type(v.kind));
    var.set_data_value(waiting());
    space.add_variables(vec![var], folder);
    id
}
