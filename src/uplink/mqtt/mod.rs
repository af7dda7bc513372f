//! The MQTT uplink: QoS 1 publishes to the fleet broker, one outbox ack per
//! PUBACK.
//!
//! One connection = one fresh rumqttc event loop, polled by its own task
//! that forwards events over a channel (so no `poll()` future is ever
//! cancelled halfway), and one [`InFlight`] table. When the connection
//! drops, the event loop, the table and the prepared messages are thrown
//! away and the next connection reads the outbox again from its oldest
//! record: whatever was in flight goes again (the fleet drops duplicates by
//! `id`), nothing is skipped. The session stays persistent on the broker
//! (clean_session = false, stable client id) as the fleet expects; for a
//! publisher that holds no broker state worth resuming at QoS 1.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rumqttc::{
    AsyncClient, ConnectionError, Event, LastWill, MqttOptions, NetworkOptions, Outgoing, Packet,
    QoS, TlsConfiguration, Transport,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

mod sparkplug_conn;

use super::inflight::InFlight;
use super::message::{Batcher, Message, Template};
use super::pace::TokenBucket;
use super::sparkplug::{self, Bounds, Session, Topics};
use super::stats::UplinkStats;
use super::{MqttConfig, PayloadFormat, STATUS_VARS, TOPIC_VARS, UplinkError, sleep_or_stop, tls};
use crate::backoff::Backoff;
use crate::outbox::{Key, Outbox};
use crate::telemetry::logging::RateLimitedLog;

/// How long a stop waits for the PUBACKs of what is in flight and of the
/// "offline" status before it disconnects.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

struct Ctx {
    cfg: MqttConfig,
    outbox: Outbox,
    stats: Arc<UplinkStats>,
    batcher: Batcher,
    status_topic: String,
    /// Where signed update commands arrive, and who takes them.
    commands: Option<(String, mpsc::Sender<Vec<u8>>)>,
    client_id: String,
    tls: Option<Arc<rustls::ClientConfig>>,
    /// Records read from the outbox at a time.
    page: usize,
    /// With `payload = "sparkplug_b"`: this edge node's topics.
    sparkplug: Option<Topics>,
    /// How big Sparkplug births may grow and how often they may come.
    bounds: Bounds,
    /// Lines a flood could repeat (node commands, evictions, a refused
    /// topic on every reconnect): one per reason and interval.
    log: RateLimitedLog,
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
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, UplinkError> {
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
    let bounds = Bounds {
        max_metrics: cfg.sparkplug_max_metrics_per_device,
        max_payload: cfg.max_packet_bytes,
        rebirth_interval: cfg.sparkplug_rebirth_interval,
    };
    let ctx = Ctx {
        sparkplug,
        bounds,
        log: RateLimitedLog::new(LOG_EVERY),
        client_id: cfg
            .client_id
            .clone()
            .unwrap_or_else(|| format!("outpost-{device}")),
        page: (cfg.batch * 8).clamp(512, 8192),
        cfg,
        outbox,
        stats,
        batcher,
        status_topic,
        commands,
        tls,
    };
    Ok(tokio::spawn(run(ctx, shutdown)))
}

/// How a connection ended.
enum End {
    Stopped,
    Lost { connected: bool, reason: String },
}

async fn run(ctx: Ctx, shutdown: CancellationToken) {
    let mut backoff = Backoff::new(ctx.cfg.backoff_min, ctx.cfg.backoff_max);
    let mut bucket = TokenBucket::new(ctx.cfg.max_bytes_per_s, Instant::now());
    let broker = format!("{}:{}", ctx.cfg.host, ctx.port());
    // Sparkplug's bdSeq: one more with every CONNECT (mod 256).
    let mut bd_seq: u64 = 0;
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        let this = bd_seq;
        bd_seq = (bd_seq + 1) % 256;
        match connection(&ctx, &mut bucket, &shutdown, this).await {
            End::Stopped => break,
            End::Lost { connected, reason } => {
                ctx.stats.set_connected(false);
                UplinkStats::add(&ctx.stats.disconnects_total, 1);
                ctx.stats.error(reason.clone());
                if connected {
                    backoff.reset();
                }
                let delay = backoff.next_delay();
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
                sparkplug::ndeath(bd_seq, unix_ms()),
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
async fn connection(
    ctx: &Ctx,
    bucket: &mut TokenBucket,
    shutdown: &CancellationToken,
    bd_seq: u64,
) -> End {
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
    let mut c = Conn {
        sparkplug: ctx
            .sparkplug
            .clone()
            .map(|t| Session::new(t, bd_seq, ctx.bounds)),
        bd_seq,
        ..Conn::default()
    };
    let notify = ctx.outbox.notified();
    loop {
        let mut rate_wait = None;
        if c.connected {
            match c.fill(ctx, &client, bucket) {
                Ok(w) => rate_wait = w,
                Err(reason) => return c.lost(ctx, reason),
            }
        }
        let idle = c.connected && c.caught_up && c.buf.is_empty();
        tokio::select! {
            ev = rx.recv() => {
                // Everything the poller has ready is handled in one go (at
                // load, a wake-up brings many PUBACKs), and their records
                // leave the outbox in one ack.
                let mut r = c.handle(ctx, &client, ev);
                let mut more = EVENTS_PER_WAKE;
                while r.is_ok() && more > 0 {
                    let Ok(ev) = rx.try_recv() else { break };
                    r = c.handle(ctx, &client, Some(ev));
                    more -= 1;
                }
                let acked = c.flush_acks(ctx);
                if let Err(reason) = r.and(acked) {
                    return c.lost(ctx, reason);
                }
            }
            _ = notify.notified(), if idle => c.caught_up = false,
            _ = tokio::time::sleep(rate_wait.unwrap_or_default()), if rate_wait.is_some() => {}
            _ = shutdown.cancelled() => return c.close(ctx, &client, &mut rx).await,
        }
    }
}

/// Events handled per wake-up of the connection task before it looks at
/// the outbox and its stop again.
const EVENTS_PER_WAKE: usize = 256;

/// The state of one connection.
#[derive(Default)]
struct Conn {
    /// Records the broker acknowledged, not yet removed from the outbox
    /// (removed together after each round of events).
    acked: Vec<Key>,
    connected: bool,
    flight: InFlight,
    /// Messages built from the outbox, not yet published.
    buf: VecDeque<Message>,
    /// The last key read from the outbox by this connection.
    cursor: Option<Key>,
    /// The last read found nothing newer: wait for an append.
    caught_up: bool,
    /// Sparkplug B births and sequence numbers of this connection.
    sparkplug: Option<Session>,
    bd_seq: u64,
    /// Sparkplug births to publish before anything else (the NBIRTH of the
    /// connection, those of a rebirth), within the in-flight window and
    /// the byte cap.
    births: VecDeque<sparkplug::Out>,
    /// NCMD rebirths asked for and not yet done (folded into one).
    rebirths_asked: u64,
}

impl Conn {
    fn lost(&self, ctx: &Ctx, reason: String) -> End {
        // What was in flight goes again on the next connection.
        UplinkStats::add(&ctx.stats.retries_total, self.flight.records() as u64);
        End::Lost {
            connected: self.connected,
            reason,
        }
    }

    fn set_inflight_gauge(&self, ctx: &Ctx) {
        ctx.stats.inflight.store(
            self.flight.records() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Publishes until the in-flight window is full, the outbox is drained
    /// or the rate cap (or a Sparkplug rebirth's pacing) says wait
    /// (returns how long).
    fn fill(
        &mut self,
        ctx: &Ctx,
        client: &AsyncClient,
        bucket: &mut TokenBucket,
    ) -> Result<Option<Duration>, String> {
        let max = ctx.cfg.max_inflight as usize;
        while self.flight.messages() < max {
            let now = Instant::now();
            if let Some(wait) = self.due_rebirth(ctx, now) {
                return Ok(Some(wait));
            }
            if !self.births.is_empty() {
                let wait = bucket.ready_in(now);
                if !wait.is_zero() {
                    return Ok(Some(wait));
                }
                let Some(b) = self.births.pop_front() else {
                    break;
                };
                bucket.take(b.payload.len(), now);
                self.publish_out(ctx, client, b, &mut None)?;
                continue;
            }
            let Some(m) = self.buf.front() else {
                if self.caught_up || !self.read(ctx)? {
                    break;
                }
                continue;
            };
            let wait = bucket.ready_in(now);
            if !wait.is_zero() {
                return Ok(Some(wait));
            }
            if self.sparkplug.is_some() {
                if let Some(wait) = self.send_sparkplug(ctx, client, bucket, now)? {
                    return Ok(Some(wait));
                }
                continue;
            }
            let n = m.keys.len() as u64;
            bucket.take(m.payload.len(), now);
            let Some(m) = self.buf.pop_front() else {
                break;
            };
            let bytes = m.payload.len() as u64;
            self.publish(client, m.topic, m.payload, m.keys)?;
            UplinkStats::add(&ctx.stats.sent_total, n);
            UplinkStats::add(&ctx.stats.bytes_total, bytes);
        }
        self.set_inflight_gauge(ctx);
        Ok(None)
    }

    /// One QoS 1 publish, booked in flight with the records it carries.
    fn publish(
        &mut self,
        client: &AsyncClient,
        topic: String,
        payload: Vec<u8>,
        keys: Vec<Key>,
    ) -> Result<(), String> {
        self.flight.requested(&topic, keys);
        client
            .try_publish(topic, QoS::AtLeastOnce, false, payload)
            .map_err(|e| format!("publish request refused: {e}"))
    }

    /// Reads the next page of the outbox into `buf`; false when there is none.
    fn read(&mut self, ctx: &Ctx) -> Result<bool, String> {
        let page = ctx
            .outbox
            .pending(self.cursor, ctx.page)
            .map_err(|e| format!("outbox read: {e}"))?;
        let Some(last) = page.last() else {
            self.caught_up = true;
            return Ok(false);
        };
        self.cursor = Some(last.key);
        let built = ctx.batcher.build(page);
        for (key, reason) in built.rejected {
            tracing::warn!(%key, %reason, "uplink: record can never be sent; moved to the dead letters");
            ctx.outbox
                .dead_letter(key, &reason)
                .map_err(|e| format!("outbox dead letter: {e}"))?;
            UplinkStats::add(&ctx.stats.dead_letters_total, 1);
        }
        self.buf.extend(built.messages);
        Ok(true)
    }

    /// One message from the poller: an event, its error, or its end.
    fn handle(
        &mut self,
        ctx: &Ctx,
        client: &AsyncClient,
        ev: Option<Result<Event, ConnectionError>>,
    ) -> Result<(), String> {
        match ev {
            None => Err("the MQTT event loop ended".to_string()),
            Some(Err(e)) => Err(self.lost_reason(ctx, &e)),
            Some(Ok(ev)) => self.on_event(ctx, client, ev),
        }
    }

    /// Why the connection ended. When the broker closed it while
    /// something waited for its answer (the CONNECT and its will, or a
    /// publish), that topic is named: a broker that refuses a topic closes
    /// the connection on it (NATS's MQTT gateway refuses a `.`).
    fn lost_reason(&self, ctx: &Ctx, e: &ConnectionError) -> String {
        let reason = e.to_string();
        if !closed_by_peer(e) {
            return reason;
        }
        let (topic, what) = if !self.connected {
            (
                ctx.will_topic(),
                "the will of the CONNECT (no CONNACK came)",
            )
        } else if let Some(t) = self.flight.oldest_unacked() {
            (t.to_string(), "a publish not yet acknowledged")
        } else {
            return reason;
        };
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
        format!("{reason}: the broker may refuse the topic `{topic}` ({what})")
    }

    /// Removes the acknowledged records from the outbox. One that fails
    /// leaves them there: the next connection sends them again.
    fn flush_acks(&mut self, ctx: &Ctx) -> Result<(), String> {
        if self.acked.is_empty() {
            return Ok(());
        }
        let keys = std::mem::take(&mut self.acked);
        ctx.outbox
            .ack(&keys)
            .map_err(|e| format!("outbox ack: {e}"))?;
        UplinkStats::add(&ctx.stats.acked_total, keys.len() as u64);
        Ok(())
    }

    fn on_event(&mut self, ctx: &Ctx, client: &AsyncClient, ev: Event) -> Result<(), String> {
        match ev {
            Event::Incoming(Packet::ConnAck(ack)) => {
                self.connected = true;
                ctx.stats.set_connected(true);
                UplinkStats::add(&ctx.stats.connects_total, 1);
                tracing::info!(
                    broker = %format!("{}:{}", ctx.cfg.host, ctx.port()),
                    client_id = %ctx.client_id,
                    session_present = ack.session_present,
                    pending = ctx.outbox.stats().records,
                    "uplink: connected to the fleet broker"
                );
                self.flight.requested(&ctx.status_topic, Vec::new());
                client
                    .try_publish(ctx.status_topic.clone(), QoS::AtLeastOnce, true, "online")
                    .map_err(|e| format!("publish request refused: {e}"))?;
                // The NBIRTH goes first of all births, under the byte cap,
                // once the subscription to NCMD below is on its way.
                if let Some(sp) = self.sparkplug.as_mut() {
                    self.births = VecDeque::from([sp.nbirth(Instant::now(), unix_ms())]);
                }
                let subs = ctx.subscriptions();
                if !subs.is_empty() {
                    client
                        .try_subscribe_many(
                            subs.into_iter()
                                .map(|t| rumqttc::SubscribeFilter::new(t, QoS::AtLeastOnce)),
                        )
                        .map_err(|e| format!("subscribe request refused: {e}"))?;
                }
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
            Event::Incoming(Packet::Publish(p))
                if ctx
                    .sparkplug
                    .as_ref()
                    .is_some_and(|t| p.topic == t.node("NCMD")) =>
            {
                self.node_command(ctx, &p.topic, &p.payload);
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
            Event::Outgoing(Outgoing::Publish(pkid)) => {
                self.flight.sent(pkid).map_err(|e| e.to_string())?;
            }
            Event::Incoming(Packet::PubAck(ack)) => {
                if let Some(keys) = self.flight.acked(ack.pkid) {
                    self.acked.extend(keys);
                }
                self.set_inflight_gauge(ctx);
            }
            Event::Incoming(Packet::Disconnect) => {
                return Err("the broker sent DISCONNECT".into());
            }
            _ => {}
        }
        Ok(())
    }

    /// A stop: wait (bounded) for the PUBACKs in flight, say "offline"
    /// (retained), disconnect cleanly so the broker does not fire the will.
    async fn close(mut self, ctx: &Ctx, client: &AsyncClient, rx: &mut Events) -> End {
        if !self.connected {
            return End::Stopped;
        }
        if client
            .try_publish(ctx.status_topic.clone(), QoS::AtLeastOnce, true, "offline")
            .is_ok()
        {
            self.flight.requested(&ctx.status_topic, Vec::new());
        }
        // Sparkplug: a clean disconnect fires no will, so say NDEATH.
        if let Some(t) = &ctx.sparkplug
            && client
                .try_publish(
                    t.node("NDEATH"),
                    QoS::AtLeastOnce,
                    false,
                    sparkplug::ndeath(self.bd_seq, unix_ms()),
                )
                .is_ok()
        {
            self.flight.requested(&t.node("NDEATH"), Vec::new());
        }
        let deadline = tokio::time::Instant::now() + CLOSE_WAIT;
        while self.flight.messages() > 0 {
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(Ok(ev)) => {
                        if self.on_event(ctx, client, ev).is_err() {
                            break;
                        }
                    }
                    _ => break,
                },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        if let Err(reason) = self.flush_acks(ctx) {
            tracing::warn!(%reason, "uplink: acknowledged records stay in the outbox and go again");
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
            unacknowledged = self.flight.records(),
            "uplink: disconnected from the fleet broker (stop)"
        );
        End::Stopped
    }
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

/// Unix milliseconds now (Sparkplug timestamps).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
