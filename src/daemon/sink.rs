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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Event, Events, IdGen};

    #[test]
    fn events_are_stored_in_the_outbox_under_their_stream_beside_results() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Outbox::open(dir.path(), Default::default()).unwrap();
        let recent = Arc::new(RecentRecords::default());
        let sink = Arc::new(OutboxSink {
            outbox: outbox.clone(),
            print: false,
            recent: recent.clone(),
        });
        let events = Events {
            ids: Arc::new(IdGen::new("gw".into(), 1)),
            sink: sink.clone(),
            stamp: crate::record::plain_stamp,
        };
        events
            .emit("gate", "gate", Event::camera_down("cam", "refused"))
            .unwrap();
        let status = serde_json::json!({"step": "installed"});
        events.emit("ota", "ota", Event::ota(status)).unwrap();
        let stored = outbox.pending(None, 10).unwrap();
        assert_eq!(stored.len(), 2);
        assert_eq!(stored[0].stream, "gate");
        let first: serde_json::Value = serde_json::from_slice(&stored[0].record).unwrap();
        assert_eq!(first["event"], "camera_down");
        assert_eq!(first["error"], "refused");
        assert_eq!(first["id"], "gw/1/1");
        assert_eq!(stored[1].stream, "ota");
        let second: serde_json::Value = serde_json::from_slice(&stored[1].record).unwrap();
        assert_eq!(second["event"]["step"], "installed");
        assert_eq!(second["pipeline"], "ota");
        // The console's recent list shows results only.
        assert!(recent.latest("gate", 10).is_empty());
        assert!(recent.latest("ota", 10).is_empty());
    }
}
