//! Modbus: a PLC's registers (or coils) polled every `interval`, each read
//! one sensor frame for the pipeline's model: a JSON array of the values,
//! stamped when the answer arrived (the record's `captured`). The stream is
//! the source's `stream` (default: the target).
//!
//! A failed read is a counted drop (`modbus_unreachable`, `modbus_timeout`,
//! `modbus_lost`, `modbus_exception_NN`), never a gap in the daemon: the next
//! tick reads again, and the connection comes back with backoff. Sources on
//! one PLC share one connection (crates/modbus `Hub`); their reads take
//! turns. A poll that comes due while the previous one is still waiting for
//! its answer or for the pipeline is skipped, not queued.

use super::{Source, SourceCtx, SourceError};

pub struct ModbusSource {
    pub cfg: crate::floor::ModbusSourceConfig,
}

#[cfg(not(feature = "modbus"))]
impl Source for ModbusSource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        Err(SourceError::Setup {
            pipeline: ctx.pipeline.clone(),
            kind: "modbus",
            detail: crate::floor::needs_modbus_build("source"),
        })
    }
}

#[cfg(feature = "modbus")]
impl Source for ModbusSource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        use std::sync::Arc;

        use bytes::Bytes;
        use outpost_modbus::poll::{Poller, json_frame};

        let cfg = self.cfg;
        let link = ctx.modbus.link(&cfg.target, cfg.timeout);
        let poller = Poller::new(&cfg);
        let stream: Arc<str> = cfg.stream_name().into();
        tracing::info!(pipeline = %ctx.pipeline, target = %cfg.target, table = cfg.table.as_str(),
            address = cfg.address, count = cfg.count, interval = ?cfg.interval, "modbus source polling");
        Ok(tokio::spawn(async move {
            let mut tick = tokio::time::interval(cfg.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut up = None;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = ctx.stopped() => return,
                }
                let read = {
                    let mut l = link.lock().await;
                    tokio::select! {
                        r = poller.poll(&mut l) => r,
                        _ = ctx.stopped() => return,
                    }
                };
                match read {
                    Ok(values) => {
                        if up != Some(true) {
                            ctx.set_state("connected");
                            up = Some(true);
                        }
                        let mut frame =
                            super::Frame::new(stream.clone(), Bytes::from(json_frame(&values)));
                        frame.captured = Some(std::time::SystemTime::now());
                        if !ctx.submit(frame).await {
                            return;
                        }
                    }
                    Err(e) => {
                        let reachable = matches!(
                            e,
                            outpost_modbus::poll::PollError::Exception(_)
                                | outpost_modbus::poll::PollError::Size { .. }
                        );
                        let state = if reachable {
                            "connected"
                        } else {
                            "reconnecting"
                        };
                        if up != Some(reachable) {
                            ctx.set_state(state);
                            up = Some(reachable);
                        }
                        ctx.count_drop(e.reason(), &format!("{}: {e}", cfg.target));
                    }
                }
            }
        }))
    }
}
