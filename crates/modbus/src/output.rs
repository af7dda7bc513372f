//! The client output on the wire: the inference thread offers each record
//! to the [`Session`] (a short lock, never a wait) and wakes the output's
//! task, which writes what is pending over its own connection. While the
//! PLC is slow or gone, records only replace pending values: nothing grows
//! and nothing waits for the PLC.

use std::sync::Arc;

use parking_lot::Mutex;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::OutputConfig;
use crate::link::{Link, LinkStats, LinkStatus, Op};
use crate::session::{Outcome, Session, SessionStats, Space, Write};

struct Shared {
    session: Mutex<Session>,
    wake: Notify,
    link: Arc<LinkStats>,
    target: String,
}

/// The handle the pipeline holds (clones share the output).
#[derive(Clone)]
pub struct ModbusOutput {
    shared: Arc<Shared>,
}

/// A modbus output's own part of `/v1/status`.
#[derive(Debug, Clone, Serialize)]
pub struct OutputStatus {
    pub link: LinkStatus,
    pub records: u64,
    pub queued: u64,
    pub replaced: u64,
    pub skipped: std::collections::BTreeMap<&'static str, u64>,
    pub requests: u64,
    pub written: u64,
    pub exceptions: std::collections::BTreeMap<u8, u64>,
    pub lost: u64,
    /// A value waits to be written.
    pub pending: bool,
}

impl ModbusOutput {
    /// Starts the output's task. Must run inside a runtime.
    pub fn start(
        cfg: &OutputConfig,
        shutdown: CancellationToken,
    ) -> (ModbusOutput, tokio::task::JoinHandle<()>) {
        let link = Link::new(&cfg.target, cfg.timeout);
        let shared = Arc::new(Shared {
            session: Mutex::new(Session::new(cfg)),
            wake: Notify::new(),
            link: link.stats.clone(),
            target: cfg.target.clone(),
        });
        let out = ModbusOutput {
            shared: shared.clone(),
        };
        let task = tokio::spawn(run(shared, link, cfg.unit, shutdown));
        (out, task)
    }

    /// Takes a record's `outputs` (the inference thread calls this).
    pub fn send(&self, outputs: &Value) {
        let pending = self.shared.session.lock().offer(outputs);
        if pending {
            self.shared.wake.notify_one();
        }
    }

    pub fn connected(&self) -> bool {
        self.shared
            .link
            .connected
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn status(&self) -> OutputStatus {
        let (st, pending): (SessionStats, bool) = {
            let s = self.shared.session.lock();
            (s.stats.clone(), s.pending())
        };
        OutputStatus {
            link: self.shared.link.status(&self.shared.target),
            records: st.records,
            queued: st.queued,
            replaced: st.replaced,
            skipped: st.skipped,
            requests: st.requests,
            written: st.written,
            exceptions: st.exceptions,
            lost: st.lost,
            pending,
        }
    }
}

fn op_of<'a>(w: &'a Write, bits: &'a mut Vec<bool>) -> Op<'a> {
    match w.space {
        Space::Registers => Op::WriteRegisters(w.address, &w.values),
        Space::Coils if w.values.len() == 1 => Op::WriteCoil(w.address, w.values[0] != 0),
        Space::Coils => {
            bits.clear();
            bits.extend(w.values.iter().map(|v| *v != 0));
            Op::WriteCoils(w.address, bits.as_slice())
        }
    }
}

async fn run(shared: Arc<Shared>, mut link: Link, unit: u8, shutdown: CancellationToken) {
    let mut bits = Vec::new();
    let mut logged_down = false;
    loop {
        if !shared.session.lock().pending() {
            tokio::select! {
                _ = shared.wake.notified() => {}
                _ = shutdown.cancelled() => return,
            }
            continue;
        }
        if !link.connected() {
            // Records meanwhile only replace pending values.
            tokio::select! {
                _ = tokio::time::sleep_until(link.ready_at()) => {}
                _ = shutdown.cancelled() => return,
            }
            match link.connect().await {
                Ok(_) => {
                    shared.session.lock().reconnected();
                    tracing::info!(target = %link.target, "modbus output connected");
                    logged_down = false;
                }
                Err(e) => {
                    if !logged_down {
                        tracing::warn!(error = %e, "modbus output: PLC unreachable; the newest values wait");
                        logged_down = true;
                    }
                    continue;
                }
            }
        }
        let writes = shared.session.lock().take();
        let mut lost = false;
        for w in &writes {
            let outcome = if lost {
                Outcome::Lost
            } else {
                let op = op_of(w, &mut bits);
                match link.call(unit, op).await {
                    Ok(Ok(_)) => Outcome::Ok,
                    Ok(Err(code)) => {
                        tracing::debug!(target = %link.target, address = w.address, code, "modbus output: exception");
                        Outcome::Exception(code)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "modbus output: connection lost");
                        lost = true;
                        Outcome::Lost
                    }
                }
            };
            shared.session.lock().done(w, outcome);
        }
        if shutdown.is_cancelled() {
            return;
        }
    }
}
