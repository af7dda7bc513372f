//! A QoS 1 mqtt source acknowledges a frame to the broker only once its
//! record is durable in the outbox: a real mosquitto, a real publisher
//! whose every frame the broker confirms, and a real `outpost run` stopped
//! with SIGTERM and killed with SIGKILL mid-stream, each time started again
//! into the broker's redelivery burst. At the end every confirmed frame has
//! its record in the outbox.

use std::collections::HashMap;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::common::*;

const FRAME: &[u8] = b"[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]";
/// Frames the publisher sends, each on a topic of its own.
const FRAMES: usize = 3000;
/// One frame every this long (500 frames/s).
const EVERY: Duration = Duration::from_millis(2);
/// Frames the broker confirms while the daemon is down, at the least: the
/// burst the next start gets is this, far above the pipeline's queue of 4.
const BACKLOG: usize = 400;

/// A mosquitto on a free loopback port with an in-flight window of
/// `inflight` messages per client; killed on drop.
struct Broker {
    child: Child,
    port: u16,
}

impl Broker {
    fn start(dir: &Path, inflight: usize) -> Broker {
        std::fs::create_dir_all(dir).unwrap();
        let port = free_port();
        let conf = dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "user root\nlistener {port} 127.0.0.1\nallow_anonymous true\n\
                 max_queued_messages 100000\nmax_queued_bytes 0\n\
                 max_inflight_messages {inflight}\n"
            ),
        )
        .unwrap();
        let child = Command::new("/usr/sbin/mosquitto")
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("mosquitto.log")).unwrap())
            .spawn()
            .expect("mosquitto (Debian package mosquitto) is needed");
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "mosquitto did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Broker { child, port }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Publishes frame `i` on `site/f{i}/vec` at QoS 1, one every [`EVERY`],
/// on one connection of its own, and counts the broker's PUBACKs.
struct Publisher {
    confirmed: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn topic(i: usize) -> String {
    format!("site/f{i}/vec")
}

impl Publisher {
    fn start(port: u16, n: usize) -> Publisher {
        let confirmed = Arc::new(AtomicUsize::new(0));
        let count = confirmed.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let o = rumqttc::MqttOptions::new(format!("pub-{port}"), "127.0.0.1", port);
                let (client, mut ev) = rumqttc::AsyncClient::new(o, 100);
                let poller = tokio::spawn(async move {
                    while count.load(Ordering::SeqCst) < n {
                        match ev.poll().await {
                            Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_))) => {
                                count.fetch_add(1, Ordering::SeqCst);
                            }
                            Ok(_) => {}
                            // Never expected: the broker keeps running.
                            Err(e) => panic!("publisher: {e}"),
                        }
                    }
                });
                let mut tick = tokio::time::interval(EVERY);
                for i in 0..n {
                    tick.tick().await;
                    client
                        .publish(topic(i), rumqttc::QoS::AtLeastOnce, false, FRAME)
                        .await
                        .unwrap();
                }
                poller.await.unwrap();
            });
        });
        Publisher {
            confirmed,
            thread: Some(thread),
        }
    }

    fn confirmed(&self) -> usize {
        self.confirmed.load(Ordering::SeqCst)
    }

    /// Waits until the broker confirmed `n` frames.
    fn wait_confirmed(&self, n: usize) {
        let t0 = Instant::now();
        while self.confirmed() < n {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the broker confirmed {} of {n}",
                self.confirmed()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn join(mut self) {
        if let Some(t) = self.thread.take() {
            t.join().expect("publisher");
        }
    }
}

/// Publishes one frame at QoS 1 and waits for its PUBACK.
fn publish_one(port: u16, topic: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let o = rumqttc::MqttOptions::new(format!("one-{}", free_port()), "127.0.0.1", port);
        let (client, mut ev) = rumqttc::AsyncClient::new(o, 10);
        client
            .publish(topic, rumqttc::QoS::AtLeastOnce, false, FRAME)
            .await
            .unwrap();
        let t0 = Instant::now();
        loop {
            assert!(t0.elapsed() < Duration::from_secs(30), "no PUBACK");
            match tokio::time::timeout(Duration::from_secs(1), ev.poll()).await {
                Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_)))) => break,
                Ok(Err(e)) => panic!("publish: {e}"),
                _ => {}
            }
        }
        let _ = client.disconnect().await;
        let _ = tokio::time::timeout(Duration::from_millis(200), ev.poll()).await;
    });
}

/// What a test changes in the daemon's config.
struct Setup {
    /// The broker's in-flight window (`max_inflight_messages`).
    broker_inflight: usize,
    /// The source's `max_inflight` (written only when not the default).
    max_inflight: usize,
    /// Keys for the pipeline table.
    pipeline: &'static str,
    /// Keys for the `[outbox]` table.
    outbox: &'static str,
}

/// A `sensors` pipeline on `site/+/vec` at QoS 1 (each record's stream is
/// its frame's topic) with a queue of 4.
fn config(port: u16, s: &Setup) -> String {
    let (extra, outbox) = (s.pipeline, s.outbox);
    let inflight = if s.max_inflight == outpost::source::DEFAULT_MAX_INFLIGHT {
        String::new()
    } else {
        format!(", max_inflight = {}", s.max_inflight)
    };
    format!(
        r#"
data_dir = "{{DATA}}"
device = "gw-acks"
[api]
listen = "{{API}}"
[site_broker]
host = "127.0.0.1"
port = {port}
[outbox]
{outbox}
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
queue = 4
{extra}
source = {{ type = "mqtt", topics = ["site/+/vec"], qos = 1{inflight} }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#
    )
}

/// Records of the publisher's frames among `records`.
fn frames_in(records: &[serde_json::Value]) -> usize {
    records
        .iter()
        .filter(|v| {
            v["stream"]
                .as_str()
                .is_some_and(|s| s.starts_with("site/f"))
        })
        .count()
}

/// Waits until `d` printed the records of `n` of the publisher's frames.
fn wait_frames(d: &mut Daemon, n: usize) {
    d.records_until(Duration::from_secs(60), |r| frames_in(r) >= n);
    assert!(frames_in(&d.seen) >= n, "{}", d.log());
}

/// The publisher's frame a record is of.
fn frame_of(record: &serde_json::Value) -> Option<usize> {
    record["stream"]
        .as_str()?
        .strip_prefix("site/f")?
        .strip_suffix("/vec")?
        .parse()
        .ok()
}

/// Waits until `d` printed the record of a frame at or after `first`.
fn wait_frame_from(d: &mut Daemon, first: usize) {
    let after = |r: &[serde_json::Value]| r.iter().any(|v| frame_of(v).is_some_and(|i| i >= first));
    d.records_until(Duration::from_secs(60), after);
    assert!(
        after(&d.seen),
        "no record of frame {first} or later:\n{}",
        d.log()
    );
}

fn dropped_oldest(d: &Daemon) -> u64 {
    d.status()["pipelines"][0]["drops"]["queue_full_drop_oldest"]
        .as_u64()
        .unwrap_or(0)
}

/// Waits until `d` printed the record of a frame published on `topic`.
fn wait_record(d: &mut Daemon, topic: &str, limit: Duration) {
    d.records_until(limit, |r| r.iter().any(|v| v["stream"] == topic));
    assert!(
        d.seen.iter().any(|v| v["stream"] == topic),
        "no record of {topic}:\n{}",
        d.log()
    );
}

/// Publishes a probe until its record shows: the source is subscribed.
fn probe(d: &mut Daemon, port: u16) {
    let t0 = Instant::now();
    loop {
        publish_one(port, "site/probe/vec");
        d.records_until(Duration::from_secs(2), |r| {
            r.iter().any(|v| v["stream"] == "site/probe/vec")
        });
        if d.seen.iter().any(|v| v["stream"] == "site/probe/vec") {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the mqtt source never subscribed:\n{}",
            d.log()
        );
    }
}

/// `(stream, boot)` of every record in the stopped daemon's outbox.
fn outbox_records(dir: &Path) -> Vec<(String, u64)> {
    let out = run(outpost().args([
        "outbox",
        "export",
        "--data-dir",
        dir.join("data").to_str().unwrap(),
    ]));
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            // Record ids are `device/boot/seq`.
            let boot = v["record"]["id"]
                .as_str()
                .and_then(|id| id.split('/').nth(1))
                .and_then(|b| b.parse().ok())
                .unwrap_or(0);
            (v["stream"].as_str().unwrap_or_default().to_string(), boot)
        })
        .collect()
}

/// What became of the frames.
#[derive(Debug)]
struct Tally {
    confirmed: usize,
    lost: usize,
    /// Records of frames that already had one (sent again by the broker).
    duplicates: usize,
    /// The most records one frame has.
    most: usize,
    /// Frames recorded before the SIGTERM and again after it.
    again_after_sigterm: usize,
    /// Frames recorded by the daemon that was killed and by the next one.
    again_after_sigkill: usize,
    dropped_oldest: u64,
}

/// Publishes [`FRAMES`] frames while the daemon is stopped (SIGTERM) and
/// killed (SIGKILL) once each mid-stream and started again into the burst
/// the broker kept meanwhile; then counts the confirmed frames without a
/// record in the outbox.
fn chaos(setup: &Setup) -> Tally {
    let work = tempfile::tempdir().unwrap();
    let broker = Broker::start(&work.path().join("mosquitto"), setup.broker_inflight);
    let cfg = config(broker.port, setup);
    let mut d = Daemon::start(&cfg);
    probe(&mut d, broker.port);
    let publisher = Publisher::start(broker.port, FRAMES);

    // Mid-stream: SIGTERM, and a backlog builds up while it is down.
    wait_frames(&mut d, 300);
    let mut dropped = dropped_oldest(&d);
    let dir = d.stop_keep_dir();
    publisher.wait_confirmed(publisher.confirmed() + BACKLOG);

    // Started into the burst; SIGKILLed once it has caught up with the
    // publisher (its latest records are the ones a group commit has not
    // covered yet).
    let caught_up = publisher.confirmed() + BACKLOG;
    let mut d = Daemon::start_in(&cfg, dir);
    wait_frame_from(&mut d, caught_up);
    dropped += dropped_oldest(&d);
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let dir = std::mem::replace(&mut d.dir, tempfile::tempdir().unwrap());
    drop(d);
    publisher.wait_confirmed((publisher.confirmed() + BACKLOG).min(FRAMES));

    // Started again; every frame is confirmed; a last frame published after
    // them all comes after them from the broker, so once its record shows,
    // every frame before it was handed to the daemon.
    let mut d = Daemon::start_in(&cfg, dir);
    publisher.wait_confirmed(FRAMES);
    let confirmed = publisher.confirmed();
    publisher.join();
    publish_one(broker.port, "site/end/vec");
    wait_record(&mut d, "site/end/vec", Duration::from_secs(60));
    dropped += dropped_oldest(&d);
    let dir = d.stop_keep_dir();

    // Boots: 1 before the SIGTERM, 2 before the SIGKILL, 3 the last.
    let mut boots: HashMap<String, Vec<u64>> = HashMap::new();
    for (stream, boot) in outbox_records(dir.path()) {
        if stream.starts_with("site/f") {
            boots.entry(stream).or_default().push(boot);
        }
    }
    let lost = (0..FRAMES)
        .filter(|i| !boots.contains_key(&topic(*i)))
        .count();
    Tally {
        confirmed,
        lost,
        duplicates: boots.values().map(|b| b.len() - 1).sum(),
        most: boots.values().map(|b| b.len()).max().unwrap_or(0),
        again_after_sigterm: boots
            .values()
            .filter(|b| b.contains(&1) && b.len() > 1)
            .count(),
        again_after_sigkill: boots.values().filter(|b| b[..] == [2, 3]).count(),
        dropped_oldest: dropped,
    }
}

/// Frames are acknowledged, not only kept: what the daemon finished
/// before the SIGTERM is not sent again, and the only frames that come
/// again are those the killed daemon had recorded without its
/// acknowledgement reaching the broker (duplicates the fleet drops by id).
fn acknowledged_on_stop(t: &Tally) {
    assert_eq!(t.again_after_sigterm, 0, "{t:?}");
    assert!(t.most <= 2, "{t:?}");
    assert_eq!(t.duplicates, t.again_after_sigkill, "{t:?}");
}

/// The issue: of 4,000 frames the broker confirmed, 212-263 never became
/// records, dropped (`queue_full_drop_oldest`) from the queue in the burst
/// the broker redelivers after each start. Now a QoS 1 source blocks by
/// default and holds the burst back with unacknowledged messages (the
/// default `max_inflight`, behind mosquitto's default window of 20), and
/// nothing confirmed is lost.
#[test]
fn qos1_frames_acknowledged_then_dropped_in_the_restart_burst() {
    let setup = Setup {
        broker_inflight: 20,
        max_inflight: 100,
        pipeline: "",
        outbox: "",
    };
    let t = chaos(&setup);
    eprintln!("{t:?}");
    assert_eq!(t.confirmed, FRAMES);
    assert_eq!(
        (t.lost, t.dropped_oldest),
        (0, 0),
        "confirmed frames without a record: {t:?}"
    );
    acknowledged_on_stop(&t);
}

/// The issue: with `when_full = "block"` the queue dropped nothing, but the
/// frames were acknowledged as soon as they were queued, so a SIGKILL lost
/// the records not yet committed (here up to a second of them: the group
/// commit runs once a second). Now a frame is acknowledged only once its
/// record is durable; the broker sends the rest again after the restart.
#[test]
fn qos1_frames_acknowledged_before_their_records_were_durable() {
    let setup = Setup {
        broker_inflight: 1000,
        // A second of frames, so acknowledgements once a second keep up.
        max_inflight: 2000,
        pipeline: "when_full = \"block\"",
        outbox: "flush_interval = \"1s\"",
    };
    let t = chaos(&setup);
    eprintln!("{t:?}");
    assert_eq!(t.confirmed, FRAMES);
    assert_eq!(t.lost, 0, "confirmed frames without a record: {t:?}");
    acknowledged_on_stop(&t);
}

/// With `when_full` set in the config, dropping is the config's choice: a
/// frame dropped from the full queue is counted under its reason and
/// acknowledged (answered as dropped, not left unanswered), so each
/// confirmed frame is a record or a counted drop, once, and the broker
/// sends none of them again after a restart.
#[test]
fn qos1_frames_dropped_by_an_explicit_policy_are_counted_and_acknowledged() {
    const N: usize = 600;
    let work = tempfile::tempdir().unwrap();
    let broker = Broker::start(&work.path().join("mosquitto"), 20);
    let cfg = config(
        broker.port,
        &Setup {
            broker_inflight: 20,
            max_inflight: outpost::source::DEFAULT_MAX_INFLIGHT,
            pipeline: "when_full = \"drop_oldest\"",
            outbox: "",
        },
    );
    let mut d = Daemon::start(&cfg);
    probe(&mut d, broker.port);
    let dir = d.stop_keep_dir();
    // Published while the daemon is down: a burst of 600 into a queue of 4.
    let publisher = Publisher::start(broker.port, N);
    publisher.wait_confirmed(N);
    publisher.join();

    let mut d = Daemon::start_in(&cfg, dir);
    publish_one(broker.port, "site/end/vec");
    wait_record(&mut d, "site/end/vec", Duration::from_secs(60));
    // Nothing arrives after the last frame: no drop can follow.
    let dropped = dropped_oldest(&d) as usize;
    d.terminate();
    let recorded = frames_in(&d.seen);
    assert!(dropped > 0, "the burst never filled the queue");
    assert_eq!(recorded + dropped, N, "{recorded} records, {dropped} drops");
    let dir = std::mem::replace(&mut d.dir, tempfile::tempdir().unwrap());
    drop(d);

    let mut d = Daemon::start_in(&cfg, dir);
    publish_one(broker.port, "site/end2/vec");
    wait_record(&mut d, "site/end2/vec", Duration::from_secs(60));
    assert_eq!(frames_in(&d.seen), 0, "frames came again after the restart");
}

/// 50 SIGHUPs while QoS 1 frames flowed gave 0-2 duplicate records a run:
/// a reload stopped the old source before the frames it had taken were
/// acknowledged, and the broker sent them again to the new one. A reload
/// re-emits nothing and loses nothing.
#[test]
fn sighup_reloads_while_qos1_frames_flow_emit_no_duplicates() {
    let work = tempfile::tempdir().unwrap();
    let broker = Broker::start(&work.path().join("broker"), 20);
    let setup = Setup {
        broker_inflight: 20,
        max_inflight: outpost::source::DEFAULT_MAX_INFLIGHT,
        pipeline: "",
        outbox: "",
    };
    let mut d = Daemon::start(&config(broker.port, &setup));
    probe(&mut d, broker.port);
    let frames = 2000;
    let publisher = Publisher::start(broker.port, frames);
    let reloads = |d: &Daemon| d.log().matches("reloaded pipelines=").count();
    for n in 1..=50 {
        let _ = Command::new("kill")
            .arg("-HUP")
            .arg(d.child.id().to_string())
            .status();
        // The next signal once this reload is done (signals coalesce).
        let t0 = Instant::now();
        while reloads(&d) < n {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "reload {n} not done:\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    publisher.wait_confirmed(frames);
    publisher.join();
    wait_frames(&mut d, frames);
    // A duplicate would show up here: wait for the probe's record after
    // every frame, so anything sent again has had its turn too.
    publish_one(broker.port, "site/last/vec");
    wait_record(&mut d, "site/last/vec", Duration::from_secs(60));
    let mut per_frame: HashMap<usize, usize> = HashMap::new();
    for r in &d.seen {
        if let Some(i) = frame_of(r) {
            *per_frame.entry(i).or_default() += 1;
        }
    }
    let lost = (0..frames).filter(|i| !per_frame.contains_key(i)).count();
    let twice: Vec<usize> = per_frame
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(reloads(&d), 50);
    assert_eq!(lost, 0, "{}", d.log());
    assert!(twice.is_empty(), "frames recorded twice: {twice:?}");
}
