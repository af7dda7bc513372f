//! MQTT: subscribe to topics on the site's broker. When the config names no
//! site broker, the daemon runs an embedded one (rumqttd) on the configured
//! address, so sensors can publish to the gateway itself; this source then
//! connects to that.
//!
//! A message over `max_message_bytes` is counted (`too_large`) and dropped
//! without dropping the connection: the client reads packets up to MQTT's
//! own maximum, so no message can break the session (a refused read would
//! disconnect, lose what the broker had in flight, and with a persistent
//! session bring the same message back forever). The cost is that one such
//! message is held in memory while it is read; set the broker's
//! `message_size_limit` to bound it.
//!
//! QoS 1 sources use a persistent session under a stable client id
//! (`outpost-<device>-<pipeline>`), so the broker queues what is published
//! while the daemon restarts, and acknowledge a message only once nothing
//! of it can be lost: its records are durable in the outbox (the regular
//! group commit, no extra fsync), or it gave none, or a policy the config
//! chose dropped it, counted (see [`super::acks`]). Unacknowledged
//! messages are the back-pressure: the broker sends no more once its
//! in-flight window is full of them (mosquitto's `max_inflight_messages`),
//! and the source reads nothing more once it holds `max_inflight` of them
//! (mosquitto 2.0.11 sends past its own window: after one PUBACK it sends
//! a whole window more), so a redelivery burst after a restart waits
//! instead of being dropped. On a stop the source takes no new message,
//! acknowledges what the pipeline finishes within [`STOP_GRACE`], and
//! leaves the rest to be sent again.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, NetworkOptions, Outgoing, Packet, QoS};
use serde::{Deserialize, Serialize};

use super::acks::Outcome;
use super::qos1::{Window, wake_of};
use super::{Frame, Source, SourceCtx, SourceError, StreamName};
use crate::backoff::Backoff;

/// The broker MQTT sources connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAddr {
    pub host: String,
    pub port: u16,
    pub client_prefix: String,
}

pub struct MqttSource {
    pub topics: Vec<String>,
    pub qos: u8,
    pub stream: StreamName,
    pub max_message_bytes: usize,
    /// QoS 1: messages held unacknowledged at most.
    pub max_inflight: usize,
}

/// The largest packet MQTT can carry (remaining length 268,435,455 plus
/// the fixed header): what the client reads, so nothing can disconnect it.
pub const MQTT_MAX_PACKET: usize = 268_435_455 + 5;

/// How long a stopping QoS 1 source waits for the frames it handed in to
/// be stored and acknowledged; what is left then is sent again by the
/// broker at the next start.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// Names a message's stream from its topic.
pub fn stream_of(topic: &str, how: &StreamName) -> String {
    match how {
        StreamName::Topic => topic.to_string(),
        StreamName::TopicSegment(i) => topic.split('/').nth(*i).unwrap_or(topic).to_string(),
    }
}

impl Source for MqttSource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        let Some(broker) = ctx.mqtt.clone() else {
            return Err(SourceError::Setup {
                pipeline: ctx.pipeline.clone(),
                kind: "mqtt",
                detail: "no broker: set [site_broker] or [embedded_broker]".into(),
            });
        };
        let mut opts = MqttOptions::new(
            format!("{}-{}", broker.client_prefix, ctx.pipeline),
            broker.host.clone(),
            broker.port,
        );
        opts.set_keep_alive(Duration::from_secs(15));
        let persistent = self.qos == 1;
        opts.set_clean_session(!persistent);
        opts.set_manual_acks(persistent);
        opts.set_max_packet_size(MQTT_MAX_PACKET, 16 * 1024 * 1024);
        let qos = if self.qos == 1 {
            QoS::AtLeastOnce
        } else {
            QoS::AtMostOnce
        };
        // Room for the acknowledgements of every frame held, so they
        // rarely wait outside the client.
        let (client, mut eventloop) = AsyncClient::new(opts, self.max_inflight.max(64));
        let mut net = NetworkOptions::new();
        // Frames are small and latency matters more than packet count.
        net.set_tcp_nodelay(true);
        eventloop.set_network_options(net);
        tracing::info!(pipeline = %ctx.pipeline, broker = %format!("{}:{}", broker.host, broker.port), topics = ?self.topics, persistent, "mqtt source");
        Ok(tokio::spawn(async move {
            let mut window = persistent.then(|| Window::new(ctx.outbox.clone()));
            let mut connected = self
                .run(&ctx, &client, &mut eventloop, &mut window, qos)
                .await;
            if let (true, Some(w)) = (connected, window.as_mut()) {
                connected = finish(&ctx, &client, &mut eventloop, w).await;
            }
            if connected && client.try_disconnect().is_ok() {
                // Read on until the broker closes the connection after our
                // DISCONNECT: closing it ourselves with its messages unread
                // resets it, and the broker may then lose the last
                // acknowledgements (seen with mosquitto 2.0.11). Bounded: a
                // broker that stopped answering is simply left.
                let _ = tokio::time::timeout(Duration::from_secs(2), async {
                    while eventloop.poll().await.is_ok() {}
                })
                .await;
            }
        }))
    }
}

impl MqttSource {
    /// Reads messages until the daemon stops. Returns whether the
    /// connection was up when it stopped (so acknowledgements can still go
    /// out on it).
    async fn run(
        &self,
        ctx: &SourceCtx,
        client: &AsyncClient,
        eventloop: &mut EventLoop,
        window: &mut Option<Window>,
        qos: QoS,
    ) -> bool {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let pipeline = ctx.pipeline.as_str();
        let mut up = false;
        loop {
            if let Some(w) = window.as_mut() {
                w.advance(client);
            }
            // At the bound nothing more is read (TCP holds the broker back)
            // until answers and commits free the window; the poll resumes
            // to write their acknowledgements.
            let full = window
                .as_ref()
                .is_some_and(|w| w.acks.len() >= self.max_inflight);
            let ev = tokio::select! {
                ev = eventloop.poll(), if !full => ev,
                wake = wake_of(window) => {
                    if let Some(w) = window.as_mut() {
                        for (slot, p, _attempt) in w.apply(wake, pipeline, ctx.stopping()) {
                            let frame = w.frame(slot, &p, stream_of(&p.topic, &self.stream));
                            if !ctx.submit(frame).await {
                                w.acks.answered(slot, Outcome::Hold, Instant::now());
                                return up;
                            }
                        }
                    }
                    continue;
                }
                _ = ctx.stopped() => return up,
            };
            match ev {
                Ok(Event::Incoming(Packet::ConnAck(_))) => {
                    up = true;
                    backoff.reset();
                    for t in &self.topics {
                        // The request is queued to the event loop; it cannot fail while the loop runs.
                        let _ = client.subscribe(t.clone(), qos).await;
                    }
                    ctx.set_state("connected");
                    tracing::info!(pipeline = %ctx.pipeline, "mqtt source connected and subscribed");
                }
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    // Only a QoS 1 delivery has an acknowledgement to hold back.
                    let w = window.as_mut().filter(|_| p.qos == QoS::AtLeastOnce);
                    if p.payload.len() > self.max_message_bytes {
                        ctx.count_drop(
                            "too_large",
                            &format!(
                                "topic {}: {} bytes, over max_message_bytes {}",
                                p.topic,
                                p.payload.len(),
                                self.max_message_bytes
                            ),
                        );
                        // Dropped by the configured limit, counted: acknowledged in turn.
                        if let Some(w) = w {
                            w.acks.received_done(p);
                        }
                        continue;
                    }
                    match w {
                        Some(w) => {
                            let slot = w.acks.received(p.clone());
                            let frame = w.frame(slot, &p, stream_of(&p.topic, &self.stream));
                            if !ctx.submit(frame).await {
                                // Not acknowledged: the broker sends it again.
                                w.acks.answered(slot, Outcome::Hold, Instant::now());
                                return up;
                            }
                        }
                        None => {
                            let frame = Frame::new(stream_of(&p.topic, &self.stream), p.payload);
                            if !ctx.submit(frame).await {
                                return up;
                            }
                        }
                    }
                }
                Ok(Event::Outgoing(Outgoing::PubAck(_))) => {
                    if let Some(w) = window.as_mut() {
                        w.written += 1;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    up = false;
                    if let Some(w) = window.as_mut() {
                        w.connection_lost(pipeline);
                    }
                    ctx.set_state("reconnecting");
                    let delay = backoff.next_delay();
                    tracing::warn!(pipeline = %ctx.pipeline, error = %e, retry_in = ?delay, "mqtt source connection failed");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = ctx.stopped() => return false,
                    }
                }
            }
        }
    }
}

/// The stop of a QoS 1 source: no new message is taken (the broker sends
/// them again), the frames already handed in are finished, and their
/// acknowledgements written, for at most [`STOP_GRACE`]. Returns whether
/// the connection is still up.
async fn finish(
    ctx: &SourceCtx,
    client: &AsyncClient,
    eventloop: &mut EventLoop,
    w: &mut Window,
) -> bool {
    let pipeline = ctx.pipeline.as_str();
    w.acks.stop();
    let deadline = tokio::time::Instant::now() + STOP_GRACE;
    loop {
        w.advance(client);
        if w.settled() {
            return true;
        }
        tokio::select! {
            ev = eventloop.poll() => match ev {
                Ok(Event::Outgoing(Outgoing::PubAck(_))) => w.written += 1,
                // A message that comes now is not taken: never acknowledged.
                Ok(_) => {}
                Err(e) => {
                    tracing::info!(pipeline, error = %e, "mqtt source: connection ended while stopping; the broker sends the unacknowledged frames again");
                    return false;
                }
            },
            wake = w.wake() => {
                w.apply(wake, pipeline, true);
            }
            _ = tokio::time::sleep_until(deadline) => {
                tracing::warn!(pipeline, unacknowledged = w.acks.len(), "mqtt source: stopping before every frame was stored; the broker sends the rest again");
                return true;
            }
        }
    }
}

/// The embedded broker (rumqttd), for sites without one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddedBrokerConfig {
    /// Where sensors connect (MQTT 3.1.1).
    #[serde(default = "default_embedded_listen")]
    pub listen: SocketAddr,
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    #[serde(default = "default_max_payload")]
    pub max_payload_bytes: usize,
}

fn default_embedded_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 1883))
}
fn default_max_connections() -> usize {
    256
}
fn default_max_payload() -> usize {
    4 * 1024 * 1024
}

impl Default for EmbeddedBrokerConfig {
    fn default() -> Self {
        EmbeddedBrokerConfig {
            listen: default_embedded_listen(),
            max_connections: default_max_connections(),
            max_payload_bytes: default_max_payload(),
        }
    }
}

/// The site's own broker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteBrokerConfig {
    pub host: String,
    #[serde(default = "default_port")]
    pub port: u16,
}

fn default_port() -> u16 {
    1883
}

/// Why the embedded broker did not start.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedBrokerError {
    #[error("embedded broker cannot listen on {listen}: {source}")]
    Listen {
        listen: SocketAddr,
        source: std::io::Error,
    },
    #[error("embedded broker: cannot start its thread: {0}")]
    Thread(std::io::Error),
    #[error("{}", NO_EMBEDDED_BROKER)]
    NotBuilt,
}

/// What a build without the embedded broker says where one is needed.
pub const NO_EMBEDDED_BROKER: &str = "this outpost was built without the embedded MQTT broker (cargo feature `embedded-broker`): set [site_broker] to the site's broker, or use a build or package that has it";

/// Whether this build carries the embedded broker (cargo feature
/// `embedded-broker`).
pub const EMBEDDED_BROKER_BUILT: bool = cfg!(feature = "embedded-broker");

/// A build without the embedded broker: sources and outputs need
/// `[site_broker]`.
#[cfg(not(feature = "embedded-broker"))]
pub fn start_embedded_broker(_: &EmbeddedBrokerConfig) -> Result<(), EmbeddedBrokerError> {
    Err(EmbeddedBrokerError::NotBuilt)
}

/// Starts rumqttd on its own threads (it runs its own runtime). Fails when
/// the address cannot be bound.
#[cfg(feature = "embedded-broker")]
pub fn start_embedded_broker(cfg: &EmbeddedBrokerConfig) -> Result<(), EmbeddedBrokerError> {
    // Probe the address first: rumqttd reports a bind failure only in its own thread.
    std::net::TcpListener::bind(cfg.listen).map_err(|source| EmbeddedBrokerError::Listen {
        listen: cfg.listen,
        source,
    })?;
    let server = rumqttd::ServerSettings {
        name: "v4-site".into(),
        listen: cfg.listen,
        tls: None,
        next_connection_delay_ms: 1,
        connections: rumqttd::ConnectionSettings {
            connection_timeout_ms: 5000,
            max_payload_size: cfg.max_payload_bytes,
            max_inflight_count: 500,
            auth: None,
            external_auth: None,
            dynamic_filters: true,
        },
    };
    let config = rumqttd::Config {
        id: 0,
        router: rumqttd::RouterConfig {
            max_connections: cfg.max_connections,
            max_outgoing_packet_count: 2000,
            max_segment_size: 64 * 1024 * 1024,
            max_segment_count: 4,
            custom_segment: None,
            initialized_filters: None,
            shared_subscriptions_strategy: Default::default(),
        },
        v4: Some([("v4-site".to_string(), server)].into_iter().collect()),
        v5: None,
        ws: None,
        cluster: None,
        console: None,
        bridge: None,
        prometheus: None,
        metrics: None,
    };
    let mut broker = rumqttd::Broker::new(config);
    std::thread::Builder::new()
        .name("embedded-broker".into())
        .spawn(move || {
            if let Err(e) = broker.start() {
                tracing::error!(error = %e, "embedded MQTT broker stopped");
            }
        })
        .map_err(EmbeddedBrokerError::Thread)?;
    tracing::info!(listen = %cfg.listen, "embedded MQTT broker started");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_from_topics() {
        assert_eq!(
            stream_of("site/mic-1/audio", &StreamName::Topic),
            "site/mic-1/audio"
        );
        assert_eq!(
            stream_of("site/mic-1/audio", &StreamName::TopicSegment(1)),
            "mic-1"
        );
        assert_eq!(stream_of("a", &StreamName::TopicSegment(4)), "a");
    }
}
