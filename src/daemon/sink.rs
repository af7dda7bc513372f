//! The record sink every pipeline stores through, and the event sink the
//! cameras and the OTA agent store through: the same outbox.

use std::io::Write;
use std::sync::Arc;

use crate::outbox::Outbox;
use crate::pipeline::recent::RecentRecords;
use crate::pipeline::{RecordSink, ResultRecord};
use crate::record::{EventError, EventRecord, EventSink};
use crate::source::{FrameError, FrameErrorKind};

/// Records go to the outbox first; printing is for demos; the last few
/// of each pipeline stay in memory for the console. Events go to the
/// outbox only: `--print-records` and the console show results.
pub(super) struct OutboxSink {
    pub(super) outbox: Outbox,
    pub(super) print: bool,
    pub(super) recent: Arc<RecentRecords>,
}

fn store_error(e: crate::outbox::OutboxError) -> FrameError {
    let kind = if e.is_transient() {
        FrameErrorKind::Unavailable
    } else {
        FrameErrorKind::Store
    };
    FrameError::new(kind, e.to_string())
}

impl OutboxSink {
    /// What follows a stored record: printing (demos) and the console's recent list.
    fn stored(&self, record: &ResultRecord, bytes: &[u8]) {
        if self.print {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(bytes);
            let _ = out.write_all(b"\n");
            let _ = out.flush();
        }
        self.recent.push(&record.pipeline, bytes);
    }
}

impl RecordSink for OutboxSink {
    fn store(&self, record: &ResultRecord, bytes: &[u8]) -> Result<(), FrameError> {
        self.outbox
            .append(&record.stream, bytes)
            .map_err(store_error)?;
        self.stored(record, bytes);
        Ok(())
    }

    fn store_all(&self, records: &[(ResultRecord, Vec<u8>)]) -> Vec<Result<(), FrameError>> {
        let appended = self.outbox.append_all(
            records
                .iter()
                .map(|(r, j)| (r.stream.as_str(), j.as_slice())),
        );
        records
            .iter()
            .zip(appended)
            .map(|((r, j), a)| {
                a.map_err(store_error)?;
                self.stored(r, j);
                Ok(())
            })
            .collect()
    }
}

impl EventSink for OutboxSink {
    fn store_event(&self, event: &EventRecord) -> Result<(), EventError> {
        let bytes = event.to_json()?;
        self.outbox
            .append(&event.stream, &bytes)
            .map(|_| ())
            .map_err(|e| EventError::Store(Box::new(e)))
    }
}
