//! Stateful batching across streams: silero VAD with `max_batch = 8` runs
//! frames of several microphones in one run (each stream's state gathered
//! into the batch axis and scattered back) and finds exactly the events the
//! unbatched pipeline finds, stream by stream.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::*;
use crate::streams::{noise, speak};

#[test]
fn silero_batched_across_streams_finds_the_same_events_as_unbatched() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, rate, _) = speak(
        tmp.path(),
        "a",
        "the pump on line three is running hot, please check it",
    );
    let (b, _, _) = speak(tmp.path(), "b", "all clear, the valve is closed again");
    let sec = |s: f64| (s * rate as f64) as usize;
    // Four microphones, each with its own mix and timing.
    let mics: Vec<Vec<i16>> = (0..4u64)
        .map(|m| {
            let mut seed = 11 + m;
            let mut audio = noise(sec(0.4 + 0.3 * m as f64), &mut seed);
            audio.extend(if m % 2 == 0 { &a } else { &b });
            audio.extend(noise(sec(1.0), &mut seed));
            audio.extend(if m % 2 == 0 { &b } else { &a });
            audio.extend(noise(sec(1.0), &mut seed));
            audio
        })
        .collect();

    let broker = free_port();
    let pipeline = |name: &str, batch: usize| {
        format!(
            r#"
[[pipelines]]
name = "{name}"
model = "silero_vad"
when_full = "block"
queue = 4096
max_batch = {batch}
max_delay = "5ms"
source = {{ type = "mqtt", topics = ["site/+/audio"], qos = 1, stream = {{ topic_segment = 1 }} }}
[pipelines.preprocess]
type = "audio"
sample_rate = 16000
input_rate = {rate}
window = 576
hop = 512
"#
        )
    };
    let mut d = Daemon::start(&format!(
        r#"
device = "gw-batch"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[scheduler]
workers = 1
[embedded_broker]
listen = "127.0.0.1:{broker}"
{}{}"#,
        pipeline("single", 1),
        pipeline("batched", 8)
    ));
    // Both pipelines' subscriptions in place before the first chunk.
    let t0 = std::time::Instant::now();
    while d
        .log()
        .matches("mqtt source connected and subscribed")
        .count()
        < 2
    {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }

    // The microphones publish 20 ms chunks, interleaved, as fast as the broker takes them.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut o = rumqttc::MqttOptions::new("mics-publisher", "127.0.0.1", broker);
        o.set_keep_alive(Duration::from_secs(10));
        let (client, mut ev) = rumqttc::AsyncClient::new(o, 1000);
        let acked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let acks = acked.clone();
        let poller = tokio::spawn(async move {
            while let Ok(e) = ev.poll().await {
                if let rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_)) = e {
                    acks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        });
        let chunks: Vec<Vec<&[i16]>> = mics.iter().map(|m| m.chunks(sec(0.02)).collect()).collect();
        let longest = chunks.iter().map(|c| c.len()).max().unwrap();
        for k in 0..longest {
            for (m, c) in chunks.iter().enumerate() {
                if let Some(chunk) = c.get(k) {
                    let bytes: Vec<u8> = chunk.iter().flat_map(|s| s.to_le_bytes()).collect();
                    client
                        .publish(
                            format!("site/mic-{m}/audio"),
                            rumqttc::QoS::AtLeastOnce,
                            false,
                            bytes,
                        )
                        .await
                        .unwrap();
                }
            }
        }
        // Every chunk acknowledged by the broker before the publisher leaves.
        let sent: usize = chunks.iter().map(|c| c.len()).sum();
        let t0 = std::time::Instant::now();
        while acked.load(std::sync::atomic::Ordering::SeqCst) < sent {
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "broker did not ack every chunk"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        client.disconnect().await.ok();
        poller.abort();
    });

    // Wait until both pipelines took every frame.
    let total: u64 = mics
        .iter()
        .map(|m| m.chunks(sec(0.02)).count() as u64)
        .sum();
    let t0 = std::time::Instant::now();
    let st = loop {
        let st = d.status();
        let done = (0..2).all(|i| st["pipelines"][i]["frames_done"].as_u64() == Some(total));
        if done {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "not done: {st}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let stored: u64 = (0..2)
        .map(|i| st["pipelines"][i]["records"].as_u64().unwrap())
        .sum();
    let recs = d
        .records_until(Duration::from_secs(20), |r| r.len() as u64 >= stored)
        .to_vec();
    let events = |pipeline: &str| {
        let mut by_stream: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for r in recs.iter().filter(|r| r["pipeline"] == pipeline) {
            by_stream
                .entry(r["stream"].as_str().unwrap().to_string())
                .or_default()
                .push(r["outputs"].to_string());
        }
        by_stream
    };
    let (single, batched) = (events("single"), events("batched"));
    assert_eq!(single.len(), 4, "every microphone spoke: {single:#?}");
    for (m, ev) in &single {
        let ends = ev.iter().filter(|e| e.contains("\"end\"")).count();
        assert!(
            ends >= 2,
            "{m}: two utterances, at least two segments: {ev:#?}"
        );
    }
    assert_eq!(batched, single, "batched events differ from unbatched ones");
    // The batched pipeline did batch: more items than runs, and at most 8 per run.
    let p = &st["pipelines"][1];
    let (runs, items) = (
        p["batches"].as_u64().unwrap(),
        p["batch_items"].as_u64().unwrap(),
    );
    assert!(items > runs, "no run took more than one stream: {p}");
    assert_eq!(
        st["pipelines"][0]["batches"],
        st["pipelines"][0]["batch_items"]
    );
    assert!(p["drops"].as_object().unwrap().is_empty(), "{p}");
}
