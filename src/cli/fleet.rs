//! `outpost fleet status` (the devices on the fleet broker, see
//! `fleet/status.rs`) and `outpost fleet rollout` (waves that stop
//! themselves, see `fleet/rollout.rs`).

use std::time::Duration;

use anyhow::{Context, bail};

use crate::fleet::status::Fleet;

#[derive(Debug, clap::Subcommand)]
pub enum FleetCommand {
    /// Devices seen on the fleet broker: retained online/offline status,
    /// model versions and last OTA step from what they publish while listening.
    Status(StatusArgs),
    /// Run a staged rollout from a plan: writes each wave's signed manifest
    /// document (to a directory or an S3-compatible bucket), follows the devices' OTA events on the fleet broker, stops
    /// and publishes the signed rollback when too many fail; resumes from
    /// its state file.
    Rollout {
        /// The plan (TOML; see docs/fleet.md).
        plan: std::path::PathBuf,
    },
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The fleet broker, HOST:PORT (MQTT 3.1.1, plain TCP).
    #[arg(long)]
    pub broker: String,
    /// First topic level of the devices' topics (`outpost/{device}/...`).
    #[arg(long, default_value = "outpost")]
    pub prefix: String,
    /// How long to listen after subscribing (retained status comes at once;
    /// versions and OTA steps as devices publish).
    #[arg(long, default_value = "3s", value_parser = humantime_serde::re::humantime::parse_duration)]
    pub listen: Duration,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: &FleetCommand) -> anyhow::Result<()> {
    match cmd {
        FleetCommand::Status(a) => status(a),
        FleetCommand::Rollout { plan } => rollout(plan),
    }
}

fn status(a: &StatusArgs) -> anyhow::Result<()> {
    let (host, port) = a
        .broker
        .rsplit_once(':')
        .and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h.to_string(), p)))
        .with_context(|| format!("--broker `{}`: expected HOST:PORT", a.broker))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let fleet = rt.block_on(listen(host, port, a))?;
    if a.json {
        let devices: Vec<_> = fleet.devices.values().collect();
        println!("{}", serde_json::to_string_pretty(&devices)?);
    } else {
        print!("{}", fleet.table());
    }
    if fleet.unreadable > 0 {
        eprintln!("{} message(s) could not be read", fleet.unreadable);
    }
    Ok(())
}

async fn listen(host: String, port: u16, a: &StatusArgs) -> anyhow::Result<Fleet> {
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
    let mut fleet = Fleet::new(&a.prefix);
    let id = format!("outpost-fleet-status-{}", std::process::id());
    let mut o = MqttOptions::new(id, host, port);
    o.set_clean_session(true)
        .set_keep_alive(Duration::from_secs(10))
        .set_max_packet_size(1 << 20, 16 << 20);
    let (client, mut ev) = AsyncClient::new(o, 16);
    client.subscribe(fleet.filter(), QoS::AtMostOnce).await?;
    let connect_by = tokio::time::Instant::now() + Duration::from_secs(10);
    // Until SUBACK: connection errors are fatal.
    loop {
        match tokio::time::timeout_at(connect_by, ev.poll()).await {
            Err(_) => bail!("no SUBACK from {} within 10 s", a.broker),
            Ok(Err(e)) => bail!("fleet broker {}: {e}", a.broker),
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => break,
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => fleet.observe(&p.topic, &p.payload),
            Ok(Ok(_)) => {}
        }
    }
    eprintln!("listening on {} for {:?}", fleet.filter(), a.listen);
    let until = tokio::time::Instant::now() + a.listen;
    loop {
        match tokio::time::timeout_at(until, ev.poll()).await {
            Err(_) => break,
            Ok(Err(e)) => bail!("fleet broker {}: {e}", a.broker),
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => fleet.observe(&p.topic, &p.payload),
            Ok(Ok(_)) => {}
        }
    }
    let _ = client.disconnect().await;
    Ok(fleet)
}

fn unix_ms() -> u64 {
    crate::ota::command::unix_ms_now()
}

fn save_state(path: &std::path::Path, s: &crate::fleet::rollout::State) -> anyhow::Result<()> {
    let bytes = serde_json::to_vec_pretty(s)?;
    crate::fsio::write_atomic(path, &bytes).with_context(|| path.display().to_string())
}

/// Where a rollout's documents go: a directory or an S3-compatible bucket.
enum Documents {
    Dir(std::path::PathBuf),
    Bucket(Box<crate::fleet::s3::Bucket>),
}

impl Documents {
    /// Checked before anything is written or subscribed to: a directory is
    /// made; a bucket is asked for `manifest.json` with the credentials (a
    /// refusal, a missing bucket or an unreachable endpoint ends the run
    /// here, with nothing written).
    async fn open(plan: &crate::fleet::rollout::Plan) -> anyhow::Result<Documents> {
        match (&plan.out_dir, &plan.s3) {
            (Some(dir), None) => {
                std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
                Ok(Documents::Dir(dir.clone()))
            }
            (None, Some(t)) => {
                let b = crate::fleet::s3::Bucket::from_env(t)?;
                b.get("manifest.json")
                    .await
                    .context("the bucket for the rollout's documents")?;
                Ok(Documents::Bucket(Box::new(b)))
            }
            // validate() says exactly one.
            _ => bail!("give `out_dir` or `[s3]`"),
        }
    }

    /// Writes a signed document as `name`, then as `manifest.json` (what
    /// devices poll): each a whole, last writer wins.
    async fn publish(&self, name: &str, doc: &str) -> anyhow::Result<()> {
        for n in [name, "manifest.json"] {
            match self {
                Documents::Dir(dir) => {
                    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
                    let p = dir.join(n);
                    crate::fsio::write_atomic(&p, doc.as_bytes())
                        .with_context(|| p.display().to_string())?;
                }
                Documents::Bucket(b) => b.put(n, doc.as_bytes().to_vec()).await?,
            }
        }
        Ok(())
    }
}

/// Retries of a failed document write: the rollout goes on following the
/// devices meanwhile, and its state moves only once the write is done.
struct WriteRetry {
    backoff: crate::backoff::Backoff,
    /// No new try before this.
    next: Option<tokio::time::Instant>,
}

impl WriteRetry {
    fn new() -> WriteRetry {
        WriteRetry {
            backoff: crate::backoff::Backoff::new(Duration::from_secs(1), Duration::from_secs(60)),
            next: None,
        }
    }

    fn due(&self) -> bool {
        self.next.is_none_or(|t| tokio::time::Instant::now() >= t)
    }

    /// Takes a write's outcome; true when it was written.
    fn outcome(&mut self, what: &str, r: anyhow::Result<()>) -> bool {
        match r {
            Ok(()) => {
                self.backoff.reset();
                self.next = None;
                true
            }
            Err(e) => {
                let delay = self.backoff.next_delay();
                self.next = Some(tokio::time::Instant::now() + delay);
                eprintln!(
                    "{what}: not written (attempt {}): {e:#}; retrying in {:.1} s",
                    self.backoff.attempts(),
                    delay.as_secs_f64()
                );
                false
            }
        }
    }
}

fn rollout(plan_path: &std::path::Path) -> anyhow::Result<()> {
    use crate::fleet::rollout::{self, Decision, Plan, State};
    let text =
        std::fs::read_to_string(plan_path).with_context(|| plan_path.display().to_string())?;
    let plan: Plan = toml::from_str(&text)
        .with_context(|| format!("{}: not a rollout plan", plan_path.display()))?;
    let problems = plan.validate();
    if !problems.is_empty() {
        bail!("{}:\n  {}", plan_path.display(), problems.join("\n  "));
    }
    let key = crate::ota::sign::read_signing_key(&plan.key)?;
    let entry = super::ota::entry(&plan.bundle, &plan.url, false)?;
    let (name, version) = (entry.name.clone(), entry.version.clone());
    let mut state: State = match std::fs::read(&plan.state) {
        Ok(b) => serde_json::from_slice(&b)
            .with_context(|| format!("{}: not a rollout state", plan.state.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::default(),
        Err(e) => return Err(e).with_context(|| plan.state.display().to_string()),
    };
    if let Some(f) = &state.finished {
        println!("rollout of {name}@{version} already over: {f}");
        return Ok(());
    }
    let (host, port) = plan
        .broker
        .rsplit_once(':')
        .and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h.to_string(), p)))
        .with_context(|| format!("broker `{}`", plan.broker))?;
    // A persistent session named after the rollout: events sent while this
    // process is down wait at the broker (QoS 1) for its restart.
    let digest = {
        use sha2::Digest;
        hex::encode(&sha2::Sha256::digest(format!("{}|{name}@{version}", plan.salt))[..8])
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
        let docs = Documents::open(&plan).await?;
        let mut retry = WriteRetry::new();
        let mut o = MqttOptions::new(format!("outpost-rollout-{digest}"), host, port);
        o.set_clean_session(false)
            .set_keep_alive(Duration::from_secs(10))
            .set_max_packet_size(1 << 20, 16 << 20);
        let (client, mut ev) = AsyncClient::new(o, 16);
        let filter = format!("{}/+/ota/#", plan.prefix.trim_end_matches('/'));
        // The event loop runs in its own task: its poll() is never cut off
        // halfway by the waits below.
        let (tx, mut rx) = tokio::sync::mpsc::channel(256);
        let poller = tokio::spawn(async move {
            loop {
                let e = ev.poll().await;
                let failed = e.is_err();
                if tx.send(e).await.is_err() {
                    break;
                }
                if failed {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        });
        let _poller = Abort(poller);
        // Nothing is published before the subscription holds: no device's
        // event may come before this process listens.
        let mut listening = false;
        loop {
            let now = unix_ms();
            rollout::time_out(&plan, &mut state, now);
            let decision = if listening {
                rollout::decide(&plan, &state, now)
            } else {
                Decision::Wait
            };
            match decision {
                Decision::WriteWave(i) => {
                    if retry.due() {
                        let w = &plan.waves[i];
                        let mut e = entry.clone();
                        e.rollout = w.percent.map(|percent| crate::ota::rollout::Rollout {
                            percent,
                            salt: plan.salt.clone(),
                        });
                        e.groups = w.groups.clone();
                        let doc = super::ota::sign_document(&key, vec![e])?;
                        let r = docs.publish(&format!("wave-{}.json", i + 1), &doc).await;
                        if retry.outcome(&format!("wave {}", i + 1), r) {
                            // Soaking counts from the moment it is written.
                            state.wave_written_ms = Some(unix_ms());
                            save_state(&plan.state, &state)?;
                            eprintln!(
                                "wave {}: {name}@{version} to {}{} (min devices {}, soak {:?})",
                                i + 1,
                                w.percent.map_or("everyone".to_string(), |p| format!("{p} %")),
                                if w.groups.is_empty() {
                                    String::new()
                                } else {
                                    format!(" of groups {}", w.groups.join(","))
                                },
                                w.min_devices,
                                w.soak
                            );
                            continue;
                        }
                    }
                }
                Decision::NextWave => {
                    state.wave += 1;
                    state.wave_written_ms = None;
                    save_state(&plan.state, &state)?;
                    continue;
                }
                Decision::Done => {
                    let (finished, failed, _) = rollout::counts(&state);
                    state.finished = Some("done".into());
                    save_state(&plan.state, &state)?;
                    println!(
                        "rollout of {name}@{version} done: {finished} device(s) finished, {failed} failed"
                    );
                    let _ = client.disconnect().await;
                    return Ok(());
                }
                Decision::Abort(reason) => {
                    if state.aborting.is_none() {
                        // Decided: a restart before the rollback is written
                        // writes it, whatever comes in meanwhile.
                        state.aborting = Some(reason.clone());
                        save_state(&plan.state, &state)?;
                    }
                    let written = match &plan.rollback {
                        None => true,
                        Some(rb) if retry.due() => {
                            let e = super::ota::entry(&rb.bundle, &rb.url, true)?;
                            let doc = super::ota::sign_document(&key, vec![e])?;
                            let r = docs.publish("rollback.json", &doc).await;
                            let ok = retry.outcome("the rollback", r);
                            if ok {
                                eprintln!("published the signed rollback");
                            }
                            ok
                        }
                        Some(_) => false,
                    };
                    if written {
                        state.aborting = None;
                        state.finished = Some(format!("aborted: {reason}"));
                        save_state(&plan.state, &state)?;
                        let _ = client.disconnect().await;
                        bail!(
                            "rollout of {name}@{version} aborted in wave {}: {reason}",
                            state.wave + 1
                        );
                    }
                }
                Decision::Wait => {}
            }
            match tokio::time::timeout(Duration::from_millis(500), rx.recv()).await {
                Err(_) | Ok(None) => {}
                Ok(Some(Err(e))) => {
                    eprintln!("fleet broker {}: {e}; retrying", plan.broker);
                }
                Ok(Some(Ok(Event::Incoming(Packet::ConnAck(_))))) => {
                    client.subscribe(filter.clone(), QoS::AtLeastOnce).await?;
                }
                Ok(Some(Ok(Event::Incoming(Packet::SubAck(_))))) => listening = true,
                Ok(Some(Ok(Event::Incoming(Packet::Publish(p))))) => {
                    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&p.payload) else {
                        continue;
                    };
                    let items = match v {
                        serde_json::Value::Array(a) => a,
                        v => vec![v],
                    };
                    let mut changed = false;
                    for r in items {
                        let e = &r["event"];
                        if e["name"] == name.as_str()
                            && e["version"] == version.as_str()
                            && let (Some(d), Some(step)) = (r["device"].as_str(), e["step"].as_str())
                        {
                            rollout::observe(&mut state, d, step, unix_ms());
                            changed = true;
                        }
                    }
                    if changed {
                        save_state(&plan.state, &state)?;
                    }
                }
                Ok(Some(Ok(_))) => {}
            }
        }
    })
}

/// Aborts a task when dropped.
struct Abort(tokio::task::JoinHandle<()>);

impl Drop for Abort {
    fn drop(&mut self) {
        self.0.abort();
    }
}
