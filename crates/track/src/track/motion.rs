//! Where a lost object should be: a track's motion from its own
//! observations, and the test that a new detection is that object coming
//! back (re-linking) rather than a new one.
//!
//! The association (ByteTrack's Kalman filter and IoU) loses an object
//! that is hidden for a few frames: its prediction drifts, and when the
//! object comes out again the detection starts a new track. Here the
//! motion is taken from the observed boxes alone (the centre's velocity
//! over the last [`WINDOW`] observations, as OC-SORT does instead of
//! trusting the filter across a gap), a lost track coasts along it, and a
//! new detection re-links to the lost track whose coasted box it fits
//! (position, size, and a heading that goes on rather than turning back)
//! before a new id is announced.
//!
//! Invariants: the window holds at most [`WINDOW`] observations, oldest
//! first, frames strictly increasing; a track with one observation does
//! not move.

use crate::postprocess::iou;

/// Observations the velocity is measured over (the newest minus the oldest).
pub const WINDOW: usize = 5;
/// A detection's width and height may each differ from the lost box's by
/// this factor at most to re-link (a person does not halve in a second).
const SIZE_RATIO: f32 = 1.5;
/// Overlap a detection needs with a moving lost object's last or coasted
/// box to re-link at once.
pub const RELINK_IOU: f32 = 0.5;
/// The largest distance, in widths of the lost box, between where each
/// side of a gap was carried and where the other side was seen that still
/// stitches (when the boxes do not overlap by `iou`).
const MAX_STITCH_DISTANCE: f32 = 0.5;
/// Moving more than this share of its height over the gap, the object has
/// a heading: a detection behind it (turned back) does not re-link.
const HEADING_AFTER: f32 = 0.3;
/// A lost box is hidden when at least this share of its coasted box lies
/// under a box seen in the frame.
const HIDDEN_SHARE: f32 = 0.3;

/// A track's recent observations.
#[derive(Debug, Clone, Default)]
pub struct Motion {
    obs: Vec<(u64, [f32; 4])>,
}

fn centre(b: &[f32; 4]) -> (f32, f32) {
    ((b[0] + b[2]) * 0.5, (b[1] + b[3]) * 0.5)
}

fn height(b: &[f32; 4]) -> f32 {
    (b[3] - b[1]).abs().max(1.0)
}

fn width(b: &[f32; 4]) -> f32 {
    (b[2] - b[0]).abs().max(1.0)
}

fn shifted(b: &[f32; 4], dx: f32, dy: f32) -> [f32; 4] {
    [b[0] + dx, b[1] + dy, b[2] + dx, b[3] + dy]
}

/// Width and height each within [`SIZE_RATIO`] of the other box's.
fn same_size(a: &[f32; 4], b: &[f32; 4]) -> bool {
    let r = |x: f32, y: f32| (1.0 / SIZE_RATIO..=SIZE_RATIO).contains(&(x / y));
    r(width(a), width(b)) && r(height(a), height(b))
}

fn centre_distance(a: &[f32; 4], b: &[f32; 4]) -> f32 {
    let (ca, cb) = (centre(a), centre(b));
    ((ca.0 - cb.0).powi(2) + (ca.1 - cb.1).powi(2)).sqrt()
}

impl Motion {
    pub fn new(frame: u64, bbox: [f32; 4]) -> Self {
        let mut obs = Vec::with_capacity(WINDOW);
        obs.push((frame, bbox));
        Motion { obs }
    }

    /// The object was seen at `bbox` in `frame` (later than the last one).
    pub fn observe(&mut self, frame: u64, bbox: [f32; 4]) {
        if self.obs.last().is_some_and(|(f, _)| *f >= frame) {
            return;
        }
        if self.obs.len() >= WINDOW {
            self.obs.remove(0);
        }
        self.obs.push((frame, bbox));
    }

    /// Takes in a later tracklet's observations (the same object, seen
    /// again).
    pub fn absorb(&mut self, later: &Motion) {
        for (f, b) in &later.obs {
            self.observe(*f, *b);
        }
    }

    /// The centre's velocity in pixels a frame over the window.
    pub fn velocity(&self) -> (f32, f32) {
        match (self.obs.first(), self.obs.last()) {
            (Some((f0, b0)), Some((f1, b1))) if f1 > f0 => {
                let dt = (f1 - f0) as f32;
                let (c0, c1) = (centre(b0), centre(b1));
                ((c1.0 - c0.0) / dt, (c1.1 - c0.1) / dt)
            }
            _ => (0.0, 0.0),
        }
    }

    /// The last observed box moved along the velocity to `frame`.
    pub fn coasted(&self, frame: u64) -> Option<[f32; 4]> {
        let (f, b) = self.obs.last()?;
        let gap = frame.saturating_sub(*f) as f32;
        let (vx, vy) = self.velocity();
        Some(shifted(b, vx * gap, vy * gap))
    }

    /// How well `det` in `frame` continues this lost object at once (the
    /// association gave it a new id): `None` when that is not clear, else a
    /// cost (lower is better). A moving object needs [`RELINK_IOU`] with
    /// its last box or its coasted one; a stationary one `min_iou` with the
    /// box it stood in. Less clear cases wait for [`Self::stitch_cost`].
    pub fn relink_cost(
        &self,
        det: &[f32; 4],
        frame: u64,
        stationary: bool,
        min_iou: f32,
    ) -> Option<f32> {
        let (_, last) = self.obs.last()?;
        if !same_size(last, det) {
            return None;
        }
        let still = iou(last, det);
        if stationary && still >= min_iou {
            return Some(1.0 - still);
        }
        let best = still.max(iou(&self.coasted(frame)?, det));
        (best >= RELINK_IOU.max(min_iou)).then_some(1.0 - best)
    }

    /// Whether `det`, which the association gave this object after it was
    /// missed, can be it: about its size, and not behind it when it was
    /// going somewhere. Two people crossing while one is hidden make the
    /// association hand the hidden one's track to the other.
    pub fn continues(&self, det: &[f32; 4], frame: u64) -> bool {
        let Some((f, last)) = self.obs.last() else {
            return true;
        };
        if !same_size(last, det) {
            return false;
        }
        let gap = frame.saturating_sub(*f) as f32;
        let (vx, vy) = self.velocity();
        if (vx * vx + vy * vy).sqrt() * gap <= HEADING_AFTER * height(last) {
            return true;
        }
        let (cl, cd) = (centre(last), centre(det));
        (cd.0 - cl.0) * vx + (cd.1 - cl.1) * vy >= 0.0
    }

    /// How well the new tracklet `new` (a few frames, not announced yet)
    /// continues this lost object: `None` when it cannot, else a cost
    /// (lower is better). Each side is carried across the gap along its
    /// own motion (this one forward to the tracklet's first frame, the
    /// tracklet back to this one's last) and must land near the other;
    /// sizes must agree, and two objects that were both going somewhere
    /// must be going the same way.
    pub fn stitch_cost(&self, new: &Motion, min_iou: f32) -> Option<f32> {
        let (f_last, last) = *self.obs.last()?;
        let (f_first, first) = *new.obs.first()?;
        if f_first <= f_last {
            return None;
        }
        if !same_size(&first, &last) {
            return None;
        }
        let gap = (f_first - f_last) as f32;
        let forward = self.coasted(f_first)?;
        let (nvx, nvy) = new.velocity();
        let back = shifted(&first, -nvx * gap, -nvy * gap);
        let w = width(&last);
        let distance =
            (centre_distance(&forward, &first) + centre_distance(&back, &last)) / (2.0 * w);
        let overlap = iou(&forward, &first).max(iou(&back, &last));
        if overlap < min_iou && distance > MAX_STITCH_DISTANCE {
            return None;
        }
        let (vx, vy) = self.velocity();
        let h = height(&last);
        let moving = |x: f32, y: f32| (x * x + y * y).sqrt() * gap > HEADING_AFTER * h;
        if moving(vx, vy) && moving(nvx, nvy) && vx * nvx + vy * nvy < 0.0 {
            return None;
        }
        Some(1.0 - overlap + distance)
    }

    /// The coasted box in `frame`, or the last one (it may have stopped),
    /// lies under one of `seen` (boxes of that frame): the object is likely
    /// hidden behind another.
    pub fn hidden(&self, frame: u64, seen: &[[f32; 4]]) -> bool {
        let (Some(c), Some((_, last))) = (self.coasted(frame), self.obs.last()) else {
            return false;
        };
        [c, *last].iter().any(|b| {
            let area = ((b[2] - b[0]) * (b[3] - b[1])).abs();
            area > 0.0
                && seen.iter().any(|s| {
                    let iw = (b[2].min(s[2]) - b[0].max(s[0])).max(0.0);
                    let ih = (b[3].min(s[3]) - b[1].max(s[1])).max(0.0);
                    iw * ih >= HIDDEN_SHARE * area
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walker(frames: std::ops::Range<u64>) -> Motion {
        let mut m = Motion::new(frames.start, [0.0; 4]);
        m.obs.clear();
        for f in frames {
            let x = 10.0 + 4.0 * f as f32;
            m.observe(f, [x, 100.0, x + 40.0, 200.0]);
        }
        m
    }

    #[test]
    fn velocity_is_measured_over_the_window_and_coasts() {
        let m = walker(1..20);
        assert_eq!(m.obs.len(), WINDOW);
        let (vx, vy) = m.velocity();
        assert!((vx - 4.0).abs() < 1e-4 && vy.abs() < 1e-4, "{vx} {vy}");
        // Lost at frame 19 (x = 86), 10 frames later it is 40 px on.
        let c = m.coasted(29).unwrap();
        assert!((c[0] - 126.0).abs() < 1e-3, "{c:?}");
    }

    #[test]
    fn a_detection_where_the_object_went_relinks_at_once_a_near_one_waits() {
        let m = walker(1..20);
        // 12 frames hidden: on its path (x = 86 + 48).
        let ahead = [134.0, 102.0, 174.0, 204.0];
        assert!(m.relink_cost(&ahead, 31, false, 0.3).is_some());
        // Half a width off its path: not clear enough at once.
        let near = [154.0, 102.0, 194.0, 204.0];
        assert!(m.relink_cost(&near, 31, false, 0.3).is_none());
        // Near where it was last seen: only a stationary object re-links
        // there.
        let stood = [106.0, 100.0, 146.0, 200.0];
        assert!(m.relink_cost(&stood, 31, false, 0.3).is_none());
        assert!(m.relink_cost(&stood, 31, true, 0.3).is_some());
    }

    #[test]
    fn a_tracklet_on_the_path_stitches_one_coming_back_or_another_size_does_not() {
        let lost = walker(1..20);
        // Seen again from frame 32 on, going on at the same pace a little
        // off the path.
        let on = walker(32..35);
        let on = Motion {
            obs: on
                .obs
                .iter()
                .map(|(f, b)| (*f, shifted(b, 12.0, 4.0)))
                .collect(),
        };
        assert!(lost.stitch_cost(&on, 0.3).is_some());
        // The same place, walking the other way.
        let mut back = Motion::default();
        for (k, f) in (32..35).enumerate() {
            let x = 146.0 - 4.0 * k as f32;
            back.observe(f, [x, 100.0, x + 40.0, 200.0]);
        }
        assert!(lost.stitch_cost(&back, 0.3).is_none());
        // On the path but twice as tall.
        let tall = Motion {
            obs: on
                .obs
                .iter()
                .map(|(f, b)| (*f, [b[0], b[1] - 100.0, b[2], b[3]]))
                .collect(),
        };
        assert!(lost.stitch_cost(&tall, 0.3).is_none());
        // Far off the path.
        let far = Motion {
            obs: on
                .obs
                .iter()
                .map(|(f, b)| (*f, shifted(b, 0.0, 150.0)))
                .collect(),
        };
        assert!(lost.stitch_cost(&far, 0.3).is_none());
    }

    #[test]
    fn a_lost_box_under_another_is_hidden() {
        let m = walker(1..20);
        let over = [120.0, 90.0, 170.0, 210.0];
        assert!(m.hidden(25, &[over]));
        assert!(!m.hidden(25, &[[400.0, 90.0, 450.0, 210.0]]));
    }
}
