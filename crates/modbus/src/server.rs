//! outpost's own Modbus TCP server: the latest value of each mapped field,
//! read-only, for PLCs and SCADA that poll.
//!
//! Why its own accept loop and frame parser (src/frame.rs) rather than
//! tokio-modbus's server: a client outside `allow` must be closed before a
//! byte of it is read, malformed frames must be counted by reason (the
//! codec of tokio-modbus ends the connection with an I/O error that does not
//! say which), and connections and idle time are bounded like the HTTP
//! API's. The protocol subset is small (MBAP and FC 1-6, 15, 16).
//!
//! Invariants:
//! - The table is written by the inference threads (a short write lock per
//!   record of a mapped pipeline) and read by connections; nothing here
//!   waits on a client.
//! - Every register (coil) a request reads must be in the map, else the
//!   answer is exception 02; a mapped one no record has set yet answers 04.
//!   Registers are served to FC 3 and FC 4 alike, coils to FC 1 and FC 2.
//! - A connection holds at most one ADU (260 bytes) of unread input and is
//!   closed when no whole request arrives within `idle_timeout`; at most
//!   `max_connections` are served, and one more is closed at once. Neither
//!   they nor any input can stop the server (each case is counted).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::config::{AllowList, ServerConfig, ServerRegister};
use crate::encode::{WordOrder, as_number, encode};
use crate::frame::{self, MAX_ADU, Pdu, code};

/// One mapped entry's cell(s): `None` until a record sets it.
#[derive(Debug, Default)]
struct Table {
    regs: BTreeMap<u16, Option<u16>>,
    coils: BTreeMap<u16, Option<bool>>,
}

/// What the server is configured to serve (swapped on reload).
#[derive(Debug)]
struct Map {
    entries: Vec<ServerRegister>,
    order: WordOrder,
    allow: AllowList,
    max_connections: usize,
    idle_timeout: Duration,
}

/// Counters of the server.
#[derive(Debug, Default)]
struct Stats {
    accepted: AtomicU64,
    requests: AtomicU64,
    idle_closed: AtomicU64,
    refused: Mutex<BTreeMap<&'static str, u64>>,
    malformed: Mutex<BTreeMap<&'static str, u64>>,
    exceptions: Mutex<BTreeMap<u8, u64>>,
    skipped: Mutex<BTreeMap<&'static str, u64>>,
}

fn bump<K: Ord>(m: &Mutex<BTreeMap<K, u64>>, k: K) {
    *m.lock().entry(k).or_default() += 1;
}

/// The server in `/v1/status`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ServerStatus {
    pub listen: String,
    pub connections: u64,
    pub accepted: u64,
    pub requests: u64,
    pub idle_closed: u64,
    /// Connections closed at once: `not_allowed`, `too_many_connections`.
    pub refused: BTreeMap<&'static str, u64>,
    /// Requests that were wrong: `protocol_id`, `bad_length` (the
    /// connection closed), `bad_pdu`, `bad_quantity`, `illegal_function`.
    pub malformed: BTreeMap<&'static str, u64>,
    /// Exception answers by code.
    pub exceptions: BTreeMap<u8, u64>,
    /// Record values that could not be served (`field_missing`, ...).
    pub skipped: BTreeMap<&'static str, u64>,
}

struct Shared {
    listen: SocketAddr,
    map: RwLock<Arc<Map>>,
    table: RwLock<Table>,
    stats: Stats,
    connections: AtomicUsize,
}

/// A running server; clones share it.
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
}

fn build(cfg: &ServerConfig) -> (Map, Table) {
    let mut t = Table::default();
    for r in &cfg.registers {
        if r.kind.is_bool() {
            t.coils.insert(r.address, None);
        } else {
            for a in 0..r.kind.width() {
                t.regs.insert(r.address.saturating_add(a), None);
            }
        }
    }
    let map = Map {
        entries: cfg.registers.clone(),
        order: cfg.word_order,
        // validate() refused bad entries; a bad one here lets nobody in.
        allow: AllowList::parse(&cfg.allow).unwrap_or_default(),
        max_connections: cfg.max_connections,
        idle_timeout: cfg.idle_timeout,
    };
    (map, t)
}

impl Server {
    /// Binds `cfg.listen` and serves until `shutdown`. Must run inside a runtime.
    pub fn start(
        cfg: &ServerConfig,
        shutdown: CancellationToken,
    ) -> std::io::Result<(Server, tokio::task::JoinHandle<()>)> {
        let std = std::net::TcpListener::bind(cfg.listen)?;
        std.set_nonblocking(true)?;
        let listener = TcpListener::from_std(std)?;
        let listen = listener.local_addr()?;
        let (map, table) = build(cfg);
        let server = Server {
            shared: Arc::new(Shared {
                listen,
                map: RwLock::new(Arc::new(map)),
                table: RwLock::new(table),
                stats: Stats::default(),
                connections: AtomicUsize::new(0),
            }),
        };
        let s = server.clone();
        let task = tokio::spawn(async move { s.accept(listener, shutdown).await });
        Ok((server, task))
    }

    /// The address bound (the port chosen when `listen` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.listen
    }

    /// A new map, allow list and limits (a reload); values of entries that
    /// stayed the same are kept. `listen` is not changed.
    pub fn reconfigure(&self, cfg: &ServerConfig) {
        let (map, mut table) = build(cfg);
        {
            let old_map = self.shared.map.read().clone();
            let old = self.shared.table.read();
            for r in &cfg.registers {
                if !old_map.entries.contains(r) || old_map.order != cfg.word_order {
                    continue;
                }
                if r.kind.is_bool() {
                    if let Some(v) = old.coils.get(&r.address) {
                        table.coils.insert(r.address, *v);
                    }
                } else {
                    for a in 0..r.kind.width() {
                        let at = r.address.saturating_add(a);
                        if let Some(v) = old.regs.get(&at) {
                            table.regs.insert(at, *v);
                        }
                    }
                }
            }
        }
        *self.shared.table.write() = table;
        *self.shared.map.write() = Arc::new(map);
    }

    /// Whether records of `pipeline` set any register.
    pub fn serves(&self, pipeline: &str) -> bool {
        self.shared
            .map
            .read()
            .entries
            .iter()
            .any(|e| e.pipeline == pipeline)
    }

    /// Takes a record's `outputs` (the inference thread calls this).
    pub fn update(&self, pipeline: &str, stream: &str, outputs: &Value) {
        let map = self.shared.map.read().clone();
        let mut cells: Vec<(u16, bool, crate::encode::Words)> = Vec::new();
        for e in &map.entries {
            if e.pipeline != pipeline || e.stream.as_deref().is_some_and(|s| s != stream) {
                continue;
            }
            let v = match outputs.pointer(&e.field) {
                None => Err("field_missing"),
                Some(v) => as_number(v).ok_or("not_a_number"),
            }
            .and_then(|v| encode(e.kind, map.order, v, e.scale, e.offset).map_err(|e| e.reason()));
            match v {
                Ok(w) => cells.push((e.address, e.kind.is_bool(), w)),
                Err(reason) => bump(&self.shared.stats.skipped, reason),
            }
        }
        if cells.is_empty() {
            return;
        }
        let mut t = self.shared.table.write();
        for (address, coil, w) in cells {
            if coil {
                t.coils.insert(address, Some(w.as_slice()[0] != 0));
            } else {
                for (i, word) in w.as_slice().iter().enumerate() {
                    t.regs.insert(address.saturating_add(i as u16), Some(*word));
                }
            }
        }
    }

    pub fn status(&self) -> ServerStatus {
        let st = &self.shared.stats;
        ServerStatus {
            listen: self.shared.listen.to_string(),
            connections: self.shared.connections.load(Ordering::Relaxed) as u64,
            accepted: st.accepted.load(Ordering::Relaxed),
            requests: st.requests.load(Ordering::Relaxed),
            idle_closed: st.idle_closed.load(Ordering::Relaxed),
            refused: st.refused.lock().clone(),
            malformed: st.malformed.lock().clone(),
            exceptions: st.exceptions.lock().clone(),
            skipped: st.skipped.lock().clone(),
        }
    }

    /// The register map as the integrator reads it: (address, kind,
    /// field, pipeline, stream), registers then coils.
    pub fn map_rows(cfg: &ServerConfig) -> Vec<&ServerRegister> {
        let mut rows: Vec<&ServerRegister> = cfg.registers.iter().collect();
        rows.sort_by_key(|r| (r.kind.is_bool(), r.address));
        rows
    }

    async fn accept(self, listener: TcpListener, shutdown: CancellationToken) {
        loop {
            let (stream, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of descriptors, say: wait a little, never spin.
                        tracing::warn!(error = %e, "modbus server: accept failed");
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                            _ = shutdown.cancelled() => return,
                        }
                    }
                },
                _ = shutdown.cancelled() => return,
            };
            let map = self.shared.map.read().clone();
            if !map.allow.allows(peer.ip()) {
                bump(&self.shared.stats.refused, "not_allowed");
                tracing::debug!(%peer, "modbus server: client not allowed");
                drop(stream);
                continue;
            }
            if self.shared.connections.load(Ordering::Relaxed) >= map.max_connections {
                bump(&self.shared.stats.refused, "too_many_connections");
                drop(stream);
                continue;
            }
            self.shared.connections.fetch_add(1, Ordering::Relaxed);
            self.shared.stats.accepted.fetch_add(1, Ordering::Relaxed);
            let s = self.clone();
            let stop = shutdown.clone();
            tokio::spawn(async move {
                s.serve(stream, stop).await;
                s.shared.connections.fetch_sub(1, Ordering::Relaxed);
            });
        }
    }

    async fn serve(&self, mut stream: TcpStream, shutdown: CancellationToken) {
        let _ = stream.set_nodelay(true);
        let mut buf = [0u8; MAX_ADU];
        let mut have = 0usize;
        let mut out = Vec::with_capacity(MAX_ADU);
        let idle = self.shared.map.read().idle_timeout;
        let mut deadline = tokio::time::Instant::now() + idle;
        loop {
            let n = tokio::select! {
                r = tokio::time::timeout_at(deadline, stream.read(&mut buf[have..])) => match r {
                    Ok(Ok(0)) | Ok(Err(_)) => return,
                    Ok(Ok(n)) => n,
                    Err(_) => {
                        self.shared.stats.idle_closed.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                },
                _ = shutdown.cancelled() => return,
            };
            have += n;
            out.clear();
            let mut used = 0;
            loop {
                match frame::parse(&buf[used..have]) {
                    Ok(Some((req, len))) => {
                        used += len;
                        self.answer(&req, &mut out);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        bump(&self.shared.stats.malformed, e.reason());
                        let _ = stream.write_all(&out).await;
                        return;
                    }
                }
            }
            if used > 0 {
                buf.copy_within(used..have, 0);
                have -= used;
                deadline = tokio::time::Instant::now() + idle;
            }
            if !out.is_empty() && stream.write_all(&out).await.is_err() {
                return;
            }
        }
    }

    fn answer(&self, req: &frame::Request, out: &mut Vec<u8>) {
        let st = &self.shared.stats;
        let refuse = |out: &mut Vec<u8>, function: u8, c: u8| {
            bump(&st.exceptions, c);
            frame::exception(out, req, function, c);
        };
        match req.pdu {
            Pdu::Refused {
                function,
                code,
                reason,
            } => {
                bump(&st.malformed, reason);
                refuse(out, function, code);
            }
            // Read-only: the map is the results' view, not a PLC's memory.
            Pdu::Write { function } => refuse(out, function, code::ILLEGAL_FUNCTION),
            Pdu::ReadWords {
                function,
                address,
                count,
            } => {
                let read = cells(&self.shared.table.read().regs, address, count);
                match read {
                    Ok(values) => {
                        st.requests.fetch_add(1, Ordering::Relaxed);
                        frame::words(out, req, function, &values);
                    }
                    Err(c) => refuse(out, function, c),
                }
            }
            Pdu::ReadBits {
                function,
                address,
                count,
            } => {
                let read = cells(&self.shared.table.read().coils, address, count);
                match read {
                    Ok(values) => {
                        st.requests.fetch_add(1, Ordering::Relaxed);
                        frame::bits(out, req, function, &values);
                    }
                    Err(c) => refuse(out, function, c),
                }
            }
        }
    }
}

/// The values of `count` cells from `address` on, or the exception code
/// that refuses the read: an address outside the map outranks a value not
/// yet set.
fn cells<T: Copy>(map: &BTreeMap<u16, Option<T>>, address: u16, count: u16) -> Result<Vec<T>, u8> {
    let range = address..=address.saturating_add(count.saturating_sub(1));
    if range.clone().any(|a| !map.contains_key(&a)) {
        return Err(code::ILLEGAL_ADDRESS);
    }
    range
        .map(|a| map.get(&a).copied().flatten().ok_or(code::DEVICE_FAILURE))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg() -> ServerConfig {
        toml::from_str(
            r#"
listen = "127.0.0.1:0"
allow = ["127.0.0.1"]
[[registers]]
pipeline = "line3"
field = "/top/0/index"
address = 0
kind = "u16"
[[registers]]
pipeline = "line3"
field = "/top/0/score"
address = 1
kind = "f32"
[[registers]]
pipeline = "line3"
field = "/alarm"
address = 0
kind = "bool"
stream = "cam-1"
"#,
        )
        .unwrap()
    }

    fn read(s: &Server, pdu: [u8; 5]) -> Vec<u8> {
        let req = frame::Request {
            transaction: 1,
            unit: 1,
            pdu: frame::parse(&[&[0, 1, 0, 0, 0, 6, 1][..], &pdu[..]].concat())
                .unwrap()
                .unwrap()
                .0
                .pdu,
        };
        let mut out = Vec::new();
        s.answer(&req, &mut out);
        out[7..].to_vec()
    }

    #[tokio::test]
    async fn reads_serve_the_latest_record_and_refuse_what_is_not_mapped() {
        let stop = CancellationToken::new();
        let (s, _t) = Server::start(&cfg(), stop.clone()).unwrap();
        assert_eq!(
            read(&s, [3, 0, 0, 0, 3]),
            [0x83, code::DEVICE_FAILURE],
            "no record yet"
        );
        assert_eq!(
            read(&s, [3, 0, 0, 0, 4]),
            [0x83, code::ILLEGAL_ADDRESS],
            "3 is not mapped"
        );
        s.update(
            "line3",
            "cam-2",
            &json!({"top": [{"index": 7, "score": 1.0}], "alarm": true}),
        );
        assert_eq!(read(&s, [3, 0, 0, 0, 3]), [3, 6, 0, 7, 0x3F, 0x80, 0, 0]);
        assert_eq!(read(&s, [4, 0, 1, 0, 2]), [4, 4, 0x3F, 0x80, 0, 0]);
        assert_eq!(read(&s, [3, 0, 0, 0, 4]), [0x83, code::ILLEGAL_ADDRESS]);
        // The coil is for stream cam-1 only.
        assert_eq!(read(&s, [1, 0, 0, 0, 1]), [0x81, code::DEVICE_FAILURE]);
        s.update("line3", "cam-1", &json!({"top": [], "alarm": true}));
        assert_eq!(read(&s, [2, 0, 0, 0, 1]), [2, 1, 1]);
        assert_eq!(
            read(&s, [3, 0, 0, 0, 1]),
            [3, 2, 0, 7],
            "a missing field keeps the value"
        );
        assert_eq!(s.status().skipped.get("field_missing"), Some(&2));
        s.update("other", "x", &json!({"top": [{"index": 9}]}));
        assert_eq!(read(&s, [3, 0, 0, 0, 1]), [3, 2, 0, 7]);
        // A reload keeps what stayed.
        let mut c = cfg();
        c.registers.truncate(2);
        s.reconfigure(&c);
        assert_eq!(read(&s, [3, 0, 0, 0, 1]), [3, 2, 0, 7]);
        assert_eq!(read(&s, [1, 0, 0, 0, 1]), [0x81, code::ILLEGAL_ADDRESS]);
        stop.cancel();
    }
}
