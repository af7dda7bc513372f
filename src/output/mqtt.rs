//! MQTT output: records published at QoS 0 to the site broker (or the
//! embedded one) through the output's own client. The inference thread only
//! queues the publish (`try_publish`); while the client is disconnected or
//! its queue is full, records drop (`disconnected`, `full`). The client
//! reconnects with backoff by itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rumqttc::{AsyncClient, ClientError, Event, MqttOptions, NetworkOptions, Packet, QoS};

use super::{Sent, render_topic};
use crate::backoff::Backoff;
use crate::source::mqtt::BrokerAddr;

/// Publishes queued in the client at most (then `full`).
const QUEUE: usize = 1024;

pub struct MqttSink {
    client: AsyncClient,
    connected: Arc<AtomicBool>,
    /// The topic with `{device}` and `{pipeline}` already replaced.
    topic: String,
}

impl MqttSink {
    pub fn start(
        broker: &BrokerAddr,
        name: &str,
        topic: &str,
        device: &str,
        pipeline: &str,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> (MqttSink, tokio::task::JoinHandle<()>) {
        let mut opts = MqttOptions::new(
            format!("{}-{name}", broker.client_prefix),
            broker.host.clone(),
            broker.port,
        );
        opts.set_keep_alive(Duration::from_secs(15));
        opts.set_clean_session(true);
        opts.set_max_packet_size(16 * 1024 * 1024, 16 * 1024 * 1024);
        let (client, mut eventloop) = AsyncClient::new(opts, QUEUE);
        let mut net = NetworkOptions::new();
        // One small publish per record: latency matters, not packet count.
        net.set_tcp_nodelay(true);
        eventloop.set_network_options(net);
        let connected = Arc::new(AtomicBool::new(false));
        let flag = connected.clone();
        let at = format!("{}:{}", broker.host, broker.port);
        let task_client = client.clone();
        let task = tokio::spawn(async move {
            let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
            loop {
                let ev = tokio::select! {
                    ev = eventloop.poll() => ev,
                    _ = shutdown.cancelled() => {
                        flag.store(false, Ordering::SeqCst);
                        let _ = task_client.try_disconnect();
                        // Let the DISCONNECT go out; bounded.
                        let _ = tokio::time::timeout(Duration::from_millis(200), eventloop.poll()).await;
                        return;
                    }
                };
                match ev {
                    Ok(Event::Incoming(Packet::ConnAck(_))) => {
                        backoff.reset();
                        flag.store(true, Ordering::SeqCst);
                        tracing::info!(broker = %at, "mqtt output connected");
                    }
                    Ok(_) => {}
                    Err(e) => {
                        let delay = backoff.next_delay();
                        if flag.swap(false, Ordering::SeqCst) {
                            tracing::warn!(broker = %at, error = %e, "mqtt output disconnected");
                        } else {
                            tracing::debug!(broker = %at, error = %e, retry_in = ?delay, "mqtt output cannot connect");
                        }
                        tokio::select! {
                            _ = tokio::time::sleep(delay) => {}
                            _ = shutdown.cancelled() => return,
                        }
                    }
                }
            }
        });
        let topic = render_topic(topic, device, pipeline, "{stream}");
        (
            MqttSink {
                client,
                connected,
                topic,
            },
            task,
        )
    }

    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    pub(super) fn send(&self, stream: &str, payload: &[u8]) -> Sent {
        if !self.connected() {
            return Sent::Dropped("disconnected");
        }
        let topic = self.topic.replace("{stream}", stream);
        match self
            .client
            .try_publish(topic, QoS::AtMostOnce, false, payload.to_vec())
        {
            Ok(()) => Sent::Ok,
            Err(ClientError::TryRequest(_)) => Sent::Dropped("full"),
            Err(_) => Sent::Dropped("error"),
        }
    }
}
