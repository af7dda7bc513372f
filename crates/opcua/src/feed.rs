//! The handoff from a pipeline to the server: one slot per pipeline that
//! holds the JSON of its latest record.
//!
//! Invariants:
//! - Offering never blocks the inference thread and never allocates once
//!   the slot's buffer has grown to a record's size: it copies the record
//!   into the slot under a lock held for that copy only (the server holds
//!   it for a buffer swap only), and wakes the server.
//! - Memory is bounded: one record per pipeline. A record the server has
//!   not taken yet when the next one arrives is replaced (the latest value
//!   wins) and counted as `superseded`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

/// One pipeline's slot.
#[derive(Default)]
pub(crate) struct Slot {
    buf: Mutex<Vec<u8>>,
    /// A record waits in `buf` that the server has not taken.
    fresh: AtomicBool,
    pub(crate) superseded: AtomicU64,
}

impl Slot {
    /// Swaps the waiting record into `out` (emptied first); false when
    /// none waits.
    pub(crate) fn take(&self, out: &mut Vec<u8>) -> bool {
        if !self.fresh.swap(false, Ordering::AcqRel) {
            return false;
        }
        out.clear();
        std::mem::swap(&mut *self.buf.lock(), out);
        true
    }
}

/// Every pipeline's slot and the server's wake-up.
#[derive(Default)]
pub(crate) struct Slots {
    pub(crate) by_pipeline: Mutex<BTreeMap<String, Arc<Slot>>>,
    pub(crate) wake: Notify,
}

/// What a pipeline offers its records through (cheap to clone).
#[derive(Clone)]
pub struct Feed {
    slot: Arc<Slot>,
    slots: Arc<Slots>,
}

impl Feed {
    pub(crate) fn new(slots: Arc<Slots>, pipeline: &str) -> Feed {
        let slot = slots
            .by_pipeline
            .lock()
            .entry(pipeline.to_string())
            .or_default()
            .clone();
        Feed { slot, slots }
    }

    /// Hands the JSON of the pipeline's newest record to the server.
    pub fn offer(&self, json: &[u8]) {
        {
            let mut b = self.slot.buf.lock();
            b.clear();
            b.extend_from_slice(json);
        }
        if self.slot.fresh.swap(true, Ordering::AcqRel) {
            self.slot.superseded.fetch_add(1, Ordering::Relaxed);
        }
        self.slots.wake.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_record_wins_and_the_replaced_one_is_counted() {
        let slots = Arc::new(Slots::default());
        let f = Feed::new(slots.clone(), "line3");
        let slot = slots.by_pipeline.lock()["line3"].clone();
        let mut out = Vec::new();
        assert!(!slot.take(&mut out));
        f.offer(b"{\"seq\":1}");
        f.offer(b"{\"seq\":2}");
        assert!(slot.take(&mut out));
        assert_eq!(out, b"{\"seq\":2}");
        assert!(!slot.take(&mut out));
        assert_eq!(slot.superseded.load(Ordering::Relaxed), 1);
        // A second feed of the same pipeline (a reload) shares the slot.
        Feed::new(slots.clone(), "line3").offer(b"3");
        assert!(slot.take(&mut out));
        assert_eq!(out, b"3");
    }
}
