//! The MQTT uplink: QoS 1 publishes to the fleet broker, one outbox ack per
//! PUBACK.
//!
//! What to publish, when, and what to ack is decided by the I/O-free
//! [`Session`] (`session/`); this file is its driver: the rumqttc event
//! loop, the outbox calls, the timers and the stop.
//!
//! One connection = one fresh rumqttc event loop, polled by its own task
//! that forwards events over a channel (so no `poll()` future is ever
//! cancelled halfway). When the connection drops, the event loop and the
//! session's state of that connection (in-flight table, prepared messages)
//! are thrown away and the next connection reads the outbox again from its
//! oldest record: whatever was in flight goes again (the fleet drops
//! duplicates by `id`), nothing is skipped. The session stays persistent on
//! the broker (clean_session = false, stable client id) as the fleet
//! expects; for a publisher that holds no broker state worth resuming at
//! QoS 1.
//!
//! Only a broker-side failure ([`UplinkError::Broker`]) ends a connection;
//! a failed outbox operation ([`UplinkError::Outbox`]) is the session's to
//! retry while the connection stays up.

mod session;

use std::sync::Arc;
use std::time::Duration;

use rumqttc::{
    AsyncClient, ConnectionError, Event, LastWill, MqttOptions, NetworkOptions, Outgoing, Packet,
    QoS, TlsConfiguration, Transport,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use self::session::StateError;
use self::session::{Command, Next, Publish, Session, Settings};
use super::message::{Batcher, Template};
use super::sparkplug::{self, Bounds, Topics};
use super::stats::UplinkStats;
use super::{MqttConfig, PayloadFormat, STATUS_VARS, TOPIC_VARS, UplinkError, sleep_or_stop, tls};
use crate::backoff::{Backoff, Jitter};
use crate::clock::clocks::Clocks;
use crate::outbox::Outbox;
use crate::telemetry::logging::RateLimitedLog;

/// How long a stop waits for the PUBACKs of what is in flight and of the
/// "offline" status before it disconnects.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// Why a broker connection ended (or never came up).
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The event loop's error; when the broker closed the connection while
    /// something waited for its answer, the topic it may have refused.
    #[error("{source}{}", refused.as_ref().map(|(topic, what)| format!(": the broker may refuse the topic `{topic}` ({what})")).unwrap_or_default())]
    Connection {
        source: Box<ConnectionError>,
        refused: Option<(String, &'static str)>,
    },
    #[error("publish request refused: {0}")]
    Publish(Box<rumqttc::ClientError>),
    #[error("subscribe request refused: {0}")]
    Subscribe(Box<rumqttc::ClientError>),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("the MQTT event loop ended")]
    Ended,
    #[error("the broker sent DISCONNECT")]
    Disconnect,
}

struct Ctx {
    cfg: MqttConfig,
    outbox: Outbox,
    stats: Arc<UplinkStats>,
    status_topic: String,
    /// Where signed update commands arrive, and who takes them.
    commands: Option<(String, mpsc::Sender<Vec<u8>>)>,
    client_id: String,
    tls: Option<Arc<rustls::ClientConfig>>,
    /// With `payload = "sparkplug_b"`: this edge node's topics.
    sparkplug: Option<Topics>,
    /// A refused topic on every reconnect: one line per interval.
    log: RateLimitedLog,
    clocks: Arc<dyn Clocks>,
}

/// How often a line that a flood repeats is logged at most (with the
/// number left out since).
const LOG_EVERY: Duration = Duration::from_secs(10);

pub(super) fn spawn(
    cfg: MqttConfig,
    outbox: Outbox,
    device: &str,
    stats: Arc<UplinkStats>,
    commands: Option<mpsc::Sender<Vec<u8>>>,
    time: super::Time,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, UplinkError> {
    let super::Time { clocks, mut jitter } = time;
    let tls = if cfg.tls {
        Some(Arc::new(tls::client_config(
            cfg.ca.as_deref(),
            cfg.cert.as_deref(),
            cfg.key.as_deref(),
        )?))
    } else {
        None
    };
    let topic =
        Template::parse(&cfg.topic, TOPIC_VARS).map_err(|e| UplinkError::Setup(e.to_string()))?;
    let status_topic = Template::parse(&cfg.status_topic, STATUS_VARS)
        .map_err(|e| UplinkError::Setup(e.to_string()))?
        .render(device, "", "");
    let commands = match commands {
        Some(tx) if !cfg.command_topic.is_empty() => Some((
            Template::parse(&cfg.command_topic, STATUS_VARS)
                .map_err(|e| UplinkError::Setup(e.to_string()))?
                .render(device, "", ""),
            tx,
        )),
        _ => None,
    };
    let batcher = Batcher {
        topic,
        device: device.to_string(),
        batch: cfg.batch,
        format: cfg.payload,
        max_payload: cfg.max_packet_bytes,
    };
    let sparkplug = (cfg.payload == PayloadFormat::SparkplugB).then(|| Topics {
        group: cfg.sparkplug_group.clone(),
        node: device.to_string(),
    });
    let ctx = Ctx {
        sparkplug,
        log: RateLimitedLog::new(LOG_EVERY),
        client_id: cfg
            .client_id
            .clone()
            .unwrap_or_else(|| format!("outpost-{device}")),
        cfg,
        outbox,
        stats,
        status_topic,
        commands,
        tls,
        clocks,
    };
    let settings = Settings {
        max_inflight: ctx.cfg.max_inflight as usize,
        page: (ctx.cfg.batch * 8).clamp(512, 8192),
        batcher,
        status_topic: ctx.status_topic.clone(),
        subscriptions: ctx.subscriptions(),
        sparkplug: ctx.sparkplug.clone(),
        bounds: Bounds {
            max_metrics: ctx.cfg.sparkplug_max_metrics_per_device,
            max_payload: ctx.cfg.max_packet_bytes,
            rebirth_interval: ctx.cfg.sparkplug_rebirth_interval,
        },
        max_bytes_per_s: ctx.cfg.max_bytes_per_s,
        backoff_min: ctx.cfg.backoff_min,
        backoff_max: ctx.cfg.backoff_max,
    };
    let session = Session::new(
        settings,
        ctx.stats.clone(),
        jitter.fork(),
        ctx.clocks.monotonic(),
    );
    Ok(tokio::spawn(run(ctx, session, jitter, shutdown)))
}

/// How a connection ended.
enum End {
    Stopped,
    Lost {
        connected: bool,
        reason: UplinkError,
    },
}

async fn run(
    ctx: Ctx,
    mut session: Session,
    mut jitter: Box<dyn Jitter>,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::new(ctx.cfg.backoff_min, ctx.cfg.backoff_max);
    let broker = format!("{}:{}", ctx.cfg.host, ctx.port());
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        match connection(&ctx, &mut session, &shutdown).await {
            End::Stopped => break,
            End::Lost { connected, reason } => {
                ctx.stats.set_connected(false);
                UplinkStats::add(&ctx.stats.disconnects_total, 1);
                let reason = reason.to_string();
                ctx.stats.error(reason.clone());
                if connected {
                    backoff.reset();
                }
                let delay = backoff.next(jitter.as_mut());
                if connected {
                    tracing::warn!(%broker, %reason, retry_in = ?delay, "uplink: disconnected from the fleet broker");
                } else {
                    tracing::warn!(%broker, %reason, attempt = backoff.attempts(), retry_in = ?delay, "uplink: cannot connect to the fleet broker");
                }
                if sleep_or_stop(delay, &shutdown).await {
                    break;
                }
            }
        }
    }
    ctx.stats.set_connected(false);
    ctx.stats
        .inflight
        .store(0, std::sync::atomic::Ordering::Relaxed);
    tracing::info!("uplink: stopped");
}

impl Ctx {
    /// The topics subscribed to at CONNECT (one SUBSCRIBE): update
    /// commands, Sparkplug node commands.
    fn subscriptions(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some((topic, _)) = &self.commands {
            v.push(topic.clone());
        }
        if let Some(t) = &self.sparkplug {
            v.push(t.node("NCMD"));
        }
        v
    }

    /// The topic of the will set at CONNECT.
    fn will_topic(&self) -> String {
        match &self.sparkplug {
            Some(t) => t.node("NDEATH"),
            None => self.status_topic.clone(),
        }
    }

    fn port(&self) -> u16 {
        self.cfg
            .port
            .unwrap_or(if self.cfg.tls { 8883 } else { 1883 })
    }

    fn options(&self, bd_seq: u64) -> MqttOptions {
        let c = &self.cfg;
        // Sparkplug: the will is the NDEATH of this connection's bdSeq.
        let will = match &self.sparkplug {
            Some(t) => LastWill::new(
                t.node("NDEATH"),
                sparkplug::ndeath(bd_seq, self.clocks.unix_ms()),
                QoS::AtLeastOnce,
                false,
            ),
            None => LastWill::new(self.status_topic.clone(), "offline", QoS::AtLeastOnce, true),
        };
        let mut o = MqttOptions::new(self.client_id.clone(), c.host.clone(), self.port());
        o.set_clean_session(false)
            .set_keep_alive(c.keep_alive)
            .set_inflight(c.max_inflight.max(1))
            // Room for the topic and the fixed header on top of the payload.
            .set_max_packet_size(64 * 1024, c.max_packet_bytes + 64 * 1024)
            .set_last_will(will);
        if let Some(u) = &c.username {
            o.set_credentials(u.clone(), c.password.clone().unwrap_or_default());
        }
        if let Some(t) = &self.tls {
            o.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(
                t.clone(),
            )));
        }
        o
    }
}

/// Aborts the poller when the connection is done with it.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

type Events = mpsc::Receiver<Result<Event, ConnectionError>>;

/// One connection, from CONNECT to its loss or a stop.
async fn connection(ctx: &Ctx, session: &mut Session, shutdown: &CancellationToken) -> End {
    let bd_seq = session.connecting();
    // Room for every message in flight plus what can go past the window:
    // a Sparkplug record's DDEATH, DBIRTH and DDATA go together (two over),
    // the subscriptions at CONNECT, offline and NDEATH at a stop; so
    // `try_publish` never finds the channel full.
    let (client, mut el) = AsyncClient::new(ctx.options(bd_seq), ctx.cfg.max_inflight as usize + 6);
    let mut net = NetworkOptions::new();
    net.set_tcp_nodelay(true);
    net.set_connection_timeout(ctx.cfg.connect_timeout.as_secs().max(1));
    el.set_network_options(net);
    let (tx, mut rx) = mpsc::channel(1024);
    let _poller = AbortOnDrop(tokio::spawn(async move {
        loop {
            let ev = el.poll().await;
            let end = ev.is_err();
            if tx.send(ev).await.is_err() || end {
                break;
            }
        }
    }));
    let notify = ctx.outbox.notified();
    // The connection's state goes; the acks of PUBACKs that came before
    // the loss still go to the outbox (and are kept for the next
    // connection if that fails).
    let lost = |session: &mut Session, e: BrokerError| {
        let connected = session.is_connected();
        session.disconnected();
        let _ = drive(ctx, session, &client);
        End::Lost {
            connected,
            reason: UplinkError::Broker(e),
        }
    };
    loop {
        let wait = match drive(ctx, session, &client) {
            Ok(w) => w,
            Err(e) => return lost(session, e),
        };
        let idle = session.waits_for_records();
        tokio::select! {
            ev = rx.recv() => {
                // Everything the poller has ready is handled in one go (at
                // load, a wake-up brings many PUBACKs), and their records
                // leave the outbox in one ack (the next `drive`).
                let mut r = handle(ctx, session, ev);
                let mut more = EVENTS_PER_WAKE;
                while r.is_ok() && more > 0 {
                    let Ok(ev) = rx.try_recv() else { break };
                    r = handle(ctx, session, Some(ev));
                    more -= 1;
                }
                if let Err(e) = r {
                    return lost(session, e);
                }
            }
            _ = notify.notified(), if idle => session.appended(),
            _ = tokio::time::sleep(wait.unwrap_or_default()), if wait.is_some() => {}
            _ = shutdown.cancelled() => return close(ctx, session, &client, &mut rx).await,
        }
    }
}

/// Events handled per wake-up of the connection task before it looks at
/// the outbox and its stop again.
const EVENTS_PER_WAKE: usize = 256;

/// Carries out what the session asks until it says wait (and how long).
/// Publishes go to rumqttc in the order given; a refused one ends the
/// connection. Outbox operations are answered at once; their failures are
/// the session's to retry and never end the connection.
fn drive(
    ctx: &Ctx,
    session: &mut Session,
    client: &AsyncClient,
) -> Result<Option<Duration>, BrokerError> {
    loop {
        let now = ctx.clocks.monotonic();
        match session.next(now, ctx.clocks.unix_ms()) {
            Next::Wait(w) => return Ok(w),
            Next::Do(Command::Publish(Publish {
                topic,
                payload,
                retain,
            })) => client
                .try_publish(topic, QoS::AtLeastOnce, retain, payload)
                .map_err(|e| BrokerError::Publish(Box::new(e)))?,
            Next::Do(Command::Subscribe(topics)) => client
                .try_subscribe_many(
                    topics
                        .into_iter()
                        .map(|t| rumqttc::SubscribeFilter::new(t, QoS::AtLeastOnce)),
                )
                .map_err(|e| BrokerError::Subscribe(Box::new(e)))?,
            Next::Do(Command::Read { after, limit }) => {
                let page = ctx.outbox.pending(after, limit);
                session.page(ctx.clocks.monotonic(), page);
            }
            Next::Do(Command::Ack(keys)) => {
                let r = ctx.outbox.ack(&keys);
                session.ack_done(ctx.clocks.monotonic(), &keys, r);
            }
            Next::Do(Command::DeadLetter { key, reason }) => {
                let r = ctx.outbox.dead_letter(key, &reason);
                session.dead_letter_done(ctx.clocks.monotonic(), key, r);
            }
        }
    }
}

/// One message from the poller: an event, its error, or its end.
fn handle(
    ctx: &Ctx,
    session: &mut Session,
    ev: Option<Result<Event, ConnectionError>>,
) -> Result<(), BrokerError> {
    match ev {
        None => Err(BrokerError::Ended),
        Some(Err(e)) => Err(lost_reason(ctx, session, e)),
        Some(Ok(ev)) => on_event(ctx, session, ev),
    }
}

/// Why the connection ended. When the broker closed it while something
/// waited for its answer (the CONNECT and its will, or a publish), that
/// topic is named: a broker that refuses a topic closes the connection on
/// it (NATS's MQTT gateway refuses a `.`).
fn lost_reason(ctx: &Ctx, session: &Session, e: ConnectionError) -> BrokerError {
    let refused = if !closed_by_peer(&e) {
        None
    } else if !session.is_connected() {
        Some((
            ctx.will_topic(),
            "the will of the CONNECT (no CONNACK came)",
        ))
    } else {
        session
            .oldest_unacked()
            .map(|t| (t.to_string(), "a publish not yet acknowledged"))
    };
    if let Some((topic, what)) = &refused {
        let hint = if topic.contains('.') {
            "; NATS's MQTT gateway, for one, refuses topics with a '.' (Sparkplug B's spBv1.0/... cannot pass it)"
        } else {
            ""
        };
        if let Some(suppressed) = ctx.log.allow("refused_topic") {
            tracing::warn!(
                refused_topic = %topic,
                suppressed,
                "uplink: the broker closed the connection on {what}: it may refuse that topic{hint}"
            );
        }
    }
    BrokerError::Connection {
        source: Box::new(e),
        refused,
    }
}

fn on_event(ctx: &Ctx, session: &mut Session, ev: Event) -> Result<(), BrokerError> {
    match ev {
        Event::Incoming(Packet::ConnAck(ack)) => {
            ctx.stats.set_connected(true);
            UplinkStats::add(&ctx.stats.connects_total, 1);
            tracing::info!(
                broker = %format!("{}:{}", ctx.cfg.host, ctx.port()),
                client_id = %ctx.client_id,
                session_present = ack.session_present,
                pending = ctx.outbox.stats().records,
                "uplink: connected to the fleet broker"
            );
            session.connected(ctx.clocks.monotonic(), ctx.clocks.unix_ms());
        }
        Event::Incoming(Packet::SubAck(ack)) => {
            // One SUBSCRIBE at CONNECT: a return code per topic, in order.
            for (topic, code) in ctx.subscriptions().iter().zip(&ack.return_codes) {
                let what = if ctx.commands.as_ref().is_some_and(|(t, _)| t == topic) {
                    "update commands"
                } else {
                    "Sparkplug node commands"
                };
                if matches!(code, rumqttc::SubscribeReasonCode::Failure) {
                    tracing::warn!(%topic, "uplink: the broker refused the subscription to {what}");
                } else {
                    tracing::info!(%topic, "uplink: subscribed to {what}");
                }
            }
        }
        Event::Incoming(Packet::Publish(p)) if session.is_node_command(&p.topic) => {
            session.node_command(&p.topic, &p.payload);
        }
        Event::Incoming(Packet::Publish(p)) => {
            if let Some((topic, tx)) = &ctx.commands
                && p.topic == *topic
            {
                if tx.try_send(p.payload.to_vec()).is_err() {
                    // A flood (junk, most likely): counted; a line per power of two.
                    let n = ctx
                        .stats
                        .commands_dropped_total
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                        + 1;
                    if n.is_power_of_two() {
                        tracing::warn!(%topic, dropped_total = n, "uplink: update command dropped: the OTA agent has not taken the previous ones");
                    }
                }
            } else {
                tracing::debug!(topic = %p.topic, "uplink: message on a topic not subscribed to");
            }
        }
        Event::Outgoing(Outgoing::Publish(pkid)) => session.sent(pkid)?,
        Event::Incoming(Packet::PubAck(ack)) => session.puback(ack.pkid),
        Event::Incoming(Packet::Disconnect) => return Err(BrokerError::Disconnect),
        _ => {}
    }
    Ok(())
}

/// A stop: wait (bounded) for the PUBACKs in flight, say "offline"
/// (retained), disconnect cleanly so the broker does not fire the will.
async fn close(ctx: &Ctx, session: &mut Session, client: &AsyncClient, rx: &mut Events) -> End {
    if !session.is_connected() {
        return End::Stopped;
    }
    session.close(ctx.clocks.unix_ms());
    let handed = drive(ctx, session, client).is_ok();
    let deadline = tokio::time::Instant::now() + CLOSE_WAIT;
    while handed && session.in_flight() > 0 {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(Ok(ev)) => {
                    if on_event(ctx, session, ev).is_err() {
                        break;
                    }
                }
                _ => break,
            },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    // The acks of what was acknowledged (one try, whatever the backoff).
    let _ = drive(ctx, session, client);
    if session.unflushed() > 0 {
        tracing::warn!(
            records = session.unflushed(),
            "uplink: acknowledged records stay in the outbox and go again"
        );
    }
    let _ = client.try_disconnect();
    // Let the poller write the DISCONNECT (it ends with an error after).
    while let Ok(Some(Ok(ev))) = tokio::time::timeout_at(deadline, rx.recv()).await {
        if matches!(ev, Event::Outgoing(Outgoing::Disconnect)) {
            break;
        }
    }
    ctx.stats.set_connected(false);
    tracing::info!(
        unacknowledged = session.in_flight_records(),
        "uplink: disconnected from the fleet broker (stop)"
    );
    End::Stopped
}

/// The broker closed the connection (rather than a timeout or a refusal
/// with a return code).
fn closed_by_peer(e: &ConnectionError) -> bool {
    use std::io::ErrorKind as K;
    match e {
        ConnectionError::MqttState(rumqttc::StateError::ConnectionAborted) => true,
        ConnectionError::MqttState(rumqttc::StateError::Io(io)) | ConnectionError::Io(io) => {
            matches!(
                io.kind(),
                K::ConnectionReset | K::ConnectionAborted | K::UnexpectedEof | K::BrokenPipe
            )
        }
        _ => false,
    }
}
