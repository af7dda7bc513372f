//! The one path a set of frames takes through a worker, whatever the
//! pipeline's mode: decode every frame, run every item at once through
//! [`Engine::run`], postprocess (the cascade merges a frame's items), the
//! cascade's stages over every result of the set at once (their crops share
//! runs), the stream hook, records to the local outputs, then the set's
//! records stored together and each frame answered.
//!
//! Each frame travels as one [`Work`] value that holds its items, its
//! results, its records and its failure, so nothing is matched up by index
//! between separate lists.

use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use serde_json::Value;

use super::super::drops::{DropReason, Dropped};
use super::super::hook::{FrameMeta, HookOutput};
use super::super::infer::{Engine, Job, Outcome};
use super::super::motion::{self, Decision};
use super::super::stages::Refine;
use super::Pipeline;
use crate::model::registry::LoadedModel;
use crate::postprocess::Postprocessor;
use crate::preprocess::crop::Rgb;
use crate::preprocess::raw::RawImage;
use crate::preprocess::{Item, Preprocessor};
use crate::record::{ResultRecord, rfc3339};
use crate::source::{Frame, FrameError, FrameErrorKind};

/// One frame on its way through a worker.
struct Work {
    frame: Frame,
    /// Decoded items (audio windows, pyramid levels, or the one tensor).
    items: Vec<Item>,
    /// The picture, decoded for the cascade's crops and thumbnails.
    picture: Option<Rgb>,
    /// The source frame's size in pixels (image pipelines).
    size: Option<(u32, u32)>,
    /// Each item's inference outcome, in the items' order.
    ran: Vec<Outcome>,
    /// Results to make records of: (the record's `outputs`, inference µs).
    results: Vec<(Value, u64)>,
    /// Records made (and sent to the local outputs), to be stored.
    made: Vec<(ResultRecord, Vec<u8>)>,
    /// Records stored: the frame's answer.
    stored: Vec<ResultRecord>,
    /// Why the frame failed (the latest failure), if it did.
    failed: Option<FrameError>,
    /// The motion gate found nothing moving: `results` holds the stream's
    /// latest detections again, and the detector does not run.
    still: bool,
    /// The detector runs on crops of the frame (motion regions): each
    /// item's crop corner in the frame, in the items' order.
    offsets: Vec<[f32; 2]>,
}

impl Work {
    fn new(frame: Frame) -> Work {
        Work {
            frame,
            items: Vec::new(),
            picture: None,
            size: None,
            ran: Vec::new(),
            results: Vec::new(),
            made: Vec::new(),
            stored: Vec::new(),
            failed: None,
            still: false,
            offsets: Vec::new(),
        }
    }
}

/// When a frame that arrived at `received` did, by the wall clock.
fn arrival(received: Instant) -> SystemTime {
    SystemTime::now()
        .checked_sub(received.elapsed())
        .unwrap_or_else(SystemTime::now)
}

impl Pipeline {
    pub(super) fn run_frames(&self, frames: Vec<Frame>, worker: usize) {
        let taken = Instant::now();
        for f in &frames {
            self.stats
                .queue_us
                .record(taken.saturating_duration_since(f.received).as_micros() as u64);
        }
        let model = self.model();
        let slot = if self.mode.serial {
            0
        } else {
            worker % self.pre.len().max(1)
        };
        let (Some(pre), Some(post)) = (self.pre.get(slot), self.post.get(slot)) else {
            // Built with one pre/postprocessor at least (Pipeline::build).
            return;
        };
        // Read before `pre` is locked: the stream table is never taken
        // while a pre/postprocessor is held.
        let tracked: Vec<Vec<[f32; 4]>> = frames
            .iter()
            .map(|f| match self.motion {
                Some(_) => self.moving_boxes(&f.stream),
                None => Vec::new(),
            })
            .collect();
        let mut work: Vec<Work> = {
            let mut pre = pre.lock();
            frames
                .into_iter()
                .zip(&tracked)
                .map(|(f, t)| self.gate(&mut **pre, f, t))
                .collect()
        };
        self.stats
            .decode_us
            .record(taken.elapsed().as_micros() as u64);
        let items: usize = work.iter().map(|w| w.items.len()).sum();
        self.stats.items.fetch_add(items as u64, Ordering::Relaxed);
        self.infer(&model, &mut work);
        let output_start = Instant::now();
        {
            let mut post = post.lock();
            for w in &mut work {
                self.postprocess(&mut **post, w);
            }
        }
        self.refine(&mut work);
        for w in &mut work {
            self.make_records(&model, w);
        }
        self.store(&mut work);
        self.stats
            .output_us
            .record(output_start.elapsed().as_micros() as u64);
        for w in work {
            self.finish(w);
        }
    }

    /// Counts a drop of `w`'s frame (or one of its items); the frame is
    /// answered with it.
    fn drop_frame(&self, w: &mut Work, d: Dropped) {
        if let Some(c) = self.stats.cameras.get(&w.frame.stream) {
            c.add_drop(d.reason.label());
        }
        self.count_drop(
            d.reason,
            &format!("stream {}: {}", w.frame.stream, d.detail),
        );
        w.failed = Some(d.error());
    }

    /// A camera frame through the motion gate first (when the pipeline has
    /// one): still, it keeps the stream's latest detections and is not
    /// decoded; moving, it is decoded whole or as crops of its regions.
    fn gate(&self, pre: &mut dyn Preprocessor, frame: Frame, tracked: &[[f32; 4]]) -> Work {
        let (Some(gate), Some(raw)) = (&self.motion, frame.raw) else {
            return self.decode(pre, frame);
        };
        let camera = self.stats.cameras.get(&frame.stream).map(|c| &c.motion);
        match gate.decide(&frame.stream, &frame.payload, raw, tracked, camera) {
            Decision::Run => self.decode(pre, frame),
            Decision::Still(v) => {
                let mut w = Work::new(frame);
                w.size = Some((raw.width, raw.height));
                w.still = true;
                w.results = vec![(v, 0)];
                w
            }
            Decision::Regions(r) => self.decode_regions(pre, frame, raw, &r),
        }
    }

    /// The boxes of the stream's tracks that may still move (see
    /// [`super::super::hook::StreamHook::moving`]).
    fn moving_boxes(&self, stream: &str) -> Vec<[f32; 4]> {
        let Some(hook) = &self.hook else {
            return Vec::new();
        };
        let table = self.streams.lock();
        table
            .get(stream)
            .and_then(Option::as_ref)
            .map(|s| hook.moving_any(s))
            .unwrap_or_default()
    }

    /// A frame decoded as crops of its moving regions (full resolution),
    /// one item each.
    fn decode_regions(
        &self,
        pre: &mut dyn Preprocessor,
        frame: Frame,
        raw: RawImage,
        regions: &[[u32; 4]],
    ) -> Work {
        let mut w = Work::new(frame);
        w.size = Some((raw.width, raw.height));
        let payload = w.frame.payload.clone();
        for r in regions {
            let (bytes, craw) = motion::regions::crop(&payload, raw, *r);
            match pre.process_raw(&w.frame.stream, &bytes, craw) {
                Ok(items) => {
                    for item in items {
                        w.items.push(item);
                        w.offsets.push([r[0] as f32, r[1] as f32]);
                    }
                }
                Err(e) => {
                    w.items.clear();
                    w.offsets.clear();
                    self.drop_frame(&mut w, Dropped::new(DropReason::Decode(e.reason()), e));
                    break;
                }
            }
        }
        w
    }

    /// Decodes a frame into its items (and, for the cascade, its picture).
    fn decode(&self, pre: &mut dyn Preprocessor, frame: Frame) -> Work {
        let mut w = Work::new(frame);
        let f = &w.frame;
        let decoded = match f.raw {
            Some(raw) => pre.process_raw(&f.stream, &f.payload, raw),
            None => pre.process(&f.stream, &f.payload),
        };
        let picture = match (&self.cascade, &decoded) {
            (Some(c), Ok(_)) => c.picture(f),
            _ => Ok(None),
        };
        match decoded.and_then(|items| picture.map(|p| (items, p))) {
            Ok((items, picture)) => {
                w.size = picture
                    .as_ref()
                    .map(|p| (p.width, p.height))
                    .or(f.raw.map(|r| (r.width, r.height)))
                    .or_else(|| {
                        let t = items.first()?.meta.image?;
                        Some((t.orig_width, t.orig_height))
                    });
                w.items = items;
                w.picture = picture;
            }
            Err(e) => self.drop_frame(&mut w, Dropped::new(DropReason::Decode(e.reason()), e)),
        }
        w
    }

    /// Runs every item of every frame in one call; each frame gets its
    /// items' outcomes back.
    fn infer(&self, model: &LoadedModel, work: &mut [Work]) {
        let engine = Engine {
            model,
            mode: &self.mode,
            states: &self.states,
            main_input: &self.main_input,
            constants: &self.constants,
            runs: &self.stats.runs,
        };
        let outcomes = {
            let jobs: Vec<Job<'_>> = work
                .iter()
                .flat_map(|w| {
                    w.items.iter().map(|it| Job {
                        stream: &w.frame.stream,
                        tensor: &it.tensor,
                    })
                })
                .collect();
            engine.run(&jobs)
        };
        let mut outcomes = outcomes.into_iter();
        for w in work.iter_mut() {
            w.ran = outcomes.by_ref().take(w.items.len()).collect();
        }
    }

    /// A frame's items to results: one per item that gives one, or, through
    /// the cascade, the items merged into one (every item must get through).
    fn postprocess(&self, post: &mut dyn Postprocessor, w: &mut Work) {
        if w.still {
            return;
        }
        let items = std::mem::take(&mut w.items);
        let ran = std::mem::take(&mut w.ran);
        let mut values = Vec::with_capacity(items.len());
        let mut offsets = Vec::with_capacity(w.offsets.len());
        let mut whole = true;
        for (i, (item, outcome)) in items.iter().zip(ran).enumerate() {
            let result = outcome.and_then(|r| {
                post.process(&w.frame.stream, &item.meta, &r.outputs)
                    .map(|v| v.map(|v| (v, r.us)))
                    .map_err(|e| Dropped::new(DropReason::Postprocess, e))
            });
            match result {
                Ok(Some(v)) => {
                    values.push(v);
                    if let Some(o) = w.offsets.get(i) {
                        offsets.push(*o);
                    }
                }
                Ok(None) => {}
                Err(d) => {
                    self.drop_frame(w, d);
                    whole = false;
                    if self.mode.cascade {
                        // No merged result without this item.
                        break;
                    }
                }
            }
        }
        w.results = if !w.offsets.is_empty() {
            // The crops of one frame: one result, boxes in the frame's pixels.
            let us = values.iter().map(|(_, us)| us).sum();
            let merged =
                motion::merge_regions(values.into_iter().map(|(v, _)| v).collect(), &offsets);
            vec![(merged, us)]
        } else if !self.mode.cascade {
            values
        } else if whole && !values.is_empty() {
            let us = values.iter().map(|(_, us)| us).sum();
            post.merge_items(values.into_iter().map(|(v, _)| v).collect())
                .map(|v| vec![(v, us)])
                .unwrap_or_default()
        } else {
            Vec::new()
        };
    }

    /// Every result of the set through the cascade's stages at once (a
    /// stage's crops of all frames share its runs); a result a stage failed
    /// on is counted (its record is still made).
    fn refine(&self, work: &mut [Work]) {
        let Some(c) = &self.cascade else {
            return;
        };
        let mut set: Vec<Refine<'_>> = Vec::new();
        for w in work.iter_mut().filter(|w| !w.still) {
            let (picture, stream) = (w.picture.as_ref(), &*w.frame.stream);
            for (value, _) in &mut w.results {
                set.push(Refine {
                    picture,
                    stream,
                    value,
                });
            }
        }
        if set.is_empty() {
            return;
        }
        let failed = c.refine(&mut set);
        for (r, e) in set.iter().zip(failed) {
            if let Some(e) = e {
                self.count_drop(DropReason::Stage, &format!("stream {}: {e}", r.stream));
            }
        }
    }

    /// Each result (refined by the cascade) through the stream hook, to a
    /// record (sent to the local outputs at once) and the hook's events.
    fn make_records(&self, model: &LoadedModel, w: &mut Work) {
        for (mut value, us) in std::mem::take(&mut w.results) {
            if let (Some(m), false) = (&self.motion, w.still) {
                m.remember(&w.frame.stream, &value);
            }
            let hooked = self.hook_frame(w, &mut value);
            self.snapshot
                .keep(&w.frame.stream, &w.frame.payload, w.frame.raw, &value);
            if let Some(c) = &self.cascade {
                c.attach_thumbnails(w.picture.as_ref(), &mut value);
            }
            let f = &w.frame;
            match self.make_record(&f.stream, f.captured, model, us, value) {
                Ok(made) => {
                    if let Some(age) = f
                        .captured
                        .and_then(|c| SystemTime::now().duration_since(c).ok())
                    {
                        self.stats.frame_age_us.record(age.as_micros() as u64);
                    }
                    if !hooked.skip_record {
                        w.made.push(made);
                    }
                }
                Err(e) => self.refused(w, e),
            }
            for event in hooked.events {
                let f = &w.frame;
                match self.make_record(&f.stream, f.captured, model, us, event) {
                    Ok(made) => w.made.push(made),
                    Err(e) => self.refused(w, e),
                }
            }
        }
    }

    /// The stream hook on one result of `w`'s frame.
    fn hook_frame(&self, w: &Work, value: &mut Value) -> HookOutput {
        let Some(hook) = &self.hook else {
            return HookOutput::default();
        };
        let f = &w.frame;
        let meta = FrameMeta {
            pipeline: &self.cfg.name,
            stream: &f.stream,
            time: f.captured.unwrap_or_else(|| arrival(f.received)),
            size: w.size,
            picture: w.picture.as_ref(),
        };
        // The stream is in flight (`process` began it), so its entry stays
        // while the hook runs outside the table's lock.
        let held = self
            .streams
            .lock()
            .get_mut(&f.stream)
            .and_then(Option::take);
        let mut state = held.unwrap_or_else(|| hook.start_any(&meta));
        let out = hook.frame_any(&mut state, &meta, value);
        if let Some(slot) = self.streams.lock().get_mut(&f.stream) {
            *slot = Some(state);
        }
        out
    }

    /// A record of `outputs` for `stream` and its JSON, already handed to
    /// the local outputs (they never wait for the outbox); the store comes
    /// after.
    fn make_record(
        &self,
        stream: &str,
        captured: Option<SystemTime>,
        model: &LoadedModel,
        latency_us: u64,
        outputs: Value,
    ) -> Result<(ResultRecord, Vec<u8>), FrameError> {
        let (id, seq) = self.ids.next();
        let stamp = crate::clock::stamp();
        let rec = ResultRecord {
            id,
            device: self.ids.device.clone(),
            pipeline: self.cfg.name.clone(),
            stream: stream.to_string(),
            seq,
            ts: stamp.ts,
            model: model.id(),
            ep: model.provider.as_str().to_string(),
            latency_us,
            outputs,
            captured: captured.map(rfc3339),
            clock: stamp.mark,
        };
        let json = serde_json::to_vec(&rec)
            .map_err(|e| FrameError::new(FrameErrorKind::Store, e.to_string()))?;
        if !self.outputs.is_empty() {
            self.outputs.send(&rec, &json);
        }
        Ok((rec, json))
    }

    /// A record of `w`'s frame that could not be encoded or stored: counted
    /// as a drop; the frame is answered with the store's own error.
    fn refused(&self, w: &mut Work, e: FrameError) {
        if let Some(c) = self.stats.cameras.get(&w.frame.stream) {
            c.add_drop(DropReason::Store.label());
        }
        self.count_drop(
            DropReason::Store,
            &format!("stream {}: {e}", w.frame.stream),
        );
        w.failed = Some(e);
    }

    /// Stores the set's records together (a store that wakes a reader per
    /// record wakes it once); each frame keeps those stored.
    fn store(&self, work: &mut [Work]) {
        let mut batch = Vec::new();
        let counts: Vec<usize> = work
            .iter_mut()
            .map(|w| {
                let n = w.made.len();
                batch.append(&mut w.made);
                n
            })
            .collect();
        if batch.is_empty() {
            return;
        }
        let stored = self.sink.store_all(&batch);
        let mut results = batch.into_iter().zip(stored);
        for (w, n) in work.iter_mut().zip(counts) {
            for ((rec, _), r) in results.by_ref().take(n) {
                match r {
                    Ok(()) => {
                        self.stats.records.fetch_add(1, Ordering::Relaxed);
                        w.stored.push(rec);
                    }
                    Err(e) => self.refused(w, e),
                }
            }
        }
    }

    /// Counts the frame done and answers whoever waits for it.
    fn finish(&self, w: Work) {
        self.stats.frames_done.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = self.stats.cameras.get(&w.frame.stream) {
            c.done(w.frame.captured);
        }
        self.stats
            .e2e_us
            .record(w.frame.received.elapsed().as_micros() as u64);
        if let Some(tx) = w.frame.reply {
            let _ = tx.send(match w.failed {
                Some(e) => Err(e),
                None => Ok(w.stored),
            });
        }
    }

    /// Hands the hook states of streams that left to the hook and stores
    /// the events it makes of them (tracks that end).
    pub(super) fn end_streams(&self, ended: Vec<super::Ended>) {
        let Some(hook) = &self.hook else {
            return;
        };
        if ended.is_empty() {
            return;
        }
        let model = self.model();
        let mut made = Vec::new();
        for (stream, state, why) in ended {
            for event in hook.end_any(&stream, state, why) {
                match self.make_record(&stream, None, &model, 0, event) {
                    Ok(m) => made.push(m),
                    Err(e) => self.count_drop(DropReason::Store, &format!("stream {stream}: {e}")),
                }
            }
        }
        if made.is_empty() {
            return;
        }
        for ((rec, _), r) in made.iter().zip(self.sink.store_all(&made)) {
            match r {
                Ok(()) => {
                    self.stats.records.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    self.count_drop(DropReason::Store, &format!("stream {}: {e}", rec.stream))
                }
            }
        }
    }
}
