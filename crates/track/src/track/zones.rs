//! Zones and lines as state machines per track: fed the bottom centre of the
//! track's box each frame it is seen, they say what changed. No I/O, no
//! clock: the frame's time comes in.
//!
//! Invariants:
//! - a zone is entered (and left) only after `inertia` consecutive frames
//!   on the other side of its edge; the event's time is the first of them;
//! - `loiter` fires at most once per visit;
//! - a track counts at most once per line and direction, and only after
//!   `inertia` consecutive frames on the new side, at least a tenth of its
//!   box's height (and `LINE_MARGIN` pixels) off the line: a box jittering
//!   on the line is no crossing until it leaves the line;
//! - passing around the end of a line is no crossing.

use std::time::{Duration, SystemTime};

use super::config::{Directions, LineConfig, ZoneConfig};
use super::events::Direction;
use super::geometry::{Place, Point, Polygon, Segment, Side};
use super::speed::{GroundPlane, SpeedUnit, SpeedWindow};

/// Points closer to a line than this (pixels) are on neither side.
pub const LINE_MARGIN: f32 = 2.0;

/// A zone, ready to test points against.
#[derive(Debug, Clone)]
pub struct Zone {
    pub name: String,
    polygon: Polygon,
    inertia: u32,
    loiter: Option<Duration>,
    classes: Vec<String>,
    pub occupancy: bool,
    pub direction: Directions,
    /// The index of the zone a track must have been in first.
    pub after: Option<usize>,
    /// Pixels to metres, when the zone is calibrated.
    pub ground: Option<GroundPlane>,
    pub unit: SpeedUnit,
    /// In metres per second.
    pub speed_limit: Option<f64>,
}

impl Zone {
    /// The zone of a checked config; `after` is resolved by the caller,
    /// who knows the other zones.
    pub fn new(c: &ZoneConfig) -> Self {
        let unit = c.unit();
        Zone {
            name: c.name.clone(),
            polygon: Polygon::new(c.points()),
            inertia: c.inertia.max(1),
            loiter: c.loiter,
            classes: c.classes.clone(),
            occupancy: c.occupancy,
            direction: c.direction,
            after: None,
            // `check` refused a calibration that fails; one that slipped
            // through measures nothing rather than something wrong.
            ground: c.ground().and_then(Result::ok),
            unit,
            speed_limit: c.speed_limit.map(|l| f64::from(l) / unit.from_mps(1.0)),
        }
    }

    pub fn inertia(&self) -> u32 {
        self.inertia
    }

    pub fn counts(&self, label: &str) -> bool {
        self.classes.is_empty() || self.classes.iter().any(|c| c == label)
    }
}

/// A counting line.
#[derive(Debug, Clone)]
pub struct Line {
    pub name: String,
    segment: Segment,
    inertia: u32,
    classes: Vec<String>,
    pub direction: Directions,
}

impl Line {
    pub fn new(c: &LineConfig) -> Self {
        let (a, b) = c.ends();
        Line {
            name: c.name.clone(),
            segment: Segment::new(a, b),
            inertia: c.inertia.max(1),
            classes: c.classes.clone(),
            direction: c.direction,
        }
    }

    pub fn counts(&self, label: &str) -> bool {
        self.classes.is_empty() || self.classes.iter().any(|c| c == label)
    }
}

/// What a zone did this frame.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ZoneChange {
    Enter { at: SystemTime },
    Leave { at: SystemTime, dwell: Duration },
    Loiter { dwell: Duration },
}

/// One track's state in one zone.
#[derive(Debug, Clone, Default)]
pub struct ZoneState {
    inside: bool,
    /// Consecutive frames on the other side of the edge, and the first one's time.
    run: u32,
    run_start: Option<SystemTime>,
    entered_at: Option<SystemTime>,
    loitered: bool,
    /// The last point's own test, before inertia: what occupancy counts.
    raw: bool,
    /// This visit does not count (the track was not in the `after` zone
    /// first): no events until it leaves.
    pub ignored: bool,
    /// Ground positions of this visit, in a calibrated zone.
    pub speed: SpeedWindow,
    /// `speeding` was told (once per track and zone).
    pub sped: bool,
}

impl ZoneState {
    pub fn inside(&self) -> bool {
        self.inside
    }

    /// Whether the last point was in the polygon.
    pub fn raw(&self) -> bool {
        self.raw
    }

    pub fn entered_at(&self) -> Option<SystemTime> {
        self.entered_at
    }

    /// One frame at `p`, time `at`.
    pub fn step(&mut self, zone: &Zone, p: Point, at: SystemTime) -> Option<ZoneChange> {
        let raw = zone.polygon.contains(p);
        self.raw = raw;
        if raw == self.inside {
            self.run = 0;
            self.run_start = None;
        } else {
            self.run += 1;
            let start = *self.run_start.get_or_insert(at);
            if self.run >= zone.inertia {
                self.inside = raw;
                self.run = 0;
                self.run_start = None;
                if raw {
                    self.entered_at = Some(start);
                    self.loitered = false;
                    return Some(ZoneChange::Enter { at: start });
                }
                let dwell = self
                    .entered_at
                    .take()
                    .and_then(|e| start.duration_since(e).ok())
                    .unwrap_or_default();
                return Some(ZoneChange::Leave { at: start, dwell });
            }
        }
        if self.inside
            && !self.loitered
            && let (Some(limit), Some(e)) = (zone.loiter, self.entered_at)
        {
            let dwell = at.duration_since(e).unwrap_or_default();
            if dwell >= limit {
                self.loitered = true;
                return Some(ZoneChange::Loiter { dwell });
            }
        }
        None
    }
}

/// Whether a track that entered a zone with `after` counts there: it must
/// have been in the `after` zone first (`visited`: the zones it entered so
/// far, counted visits only).
pub fn came_from(zone: &Zone, visited: &[usize]) -> bool {
    zone.after.is_none_or(|a| visited.contains(&a))
}

/// One track's state at one line.
#[derive(Debug, Clone, Default)]
pub struct LineState {
    settled: Option<Side>,
    run: u32,
    run_start: Option<SystemTime>,
    counted_in: bool,
    counted_out: bool,
}

/// How far off the line a box must be to be on a side: detectors' boxes
/// jitter in proportion to their size, so a tenth of the box's height, and
/// at least [`LINE_MARGIN`].
pub fn line_margin(bbox: &[f32; 4]) -> f32 {
    (0.1 * (bbox[3] - bbox[1]).abs()).max(LINE_MARGIN)
}

impl LineState {
    /// One frame at `p` (`margin` pixels off the line count as on it), time
    /// `at`: a crossing, with the time of the first frame on the new side,
    /// at most once per direction.
    pub fn step(
        &mut self,
        line: &Line,
        p: Point,
        margin: f32,
        at: SystemTime,
    ) -> Option<(Direction, SystemTime)> {
        let side = match line.segment.place(p, margin) {
            Place::Beyond => {
                // Past an end: whatever side it comes back on is no crossing.
                self.settled = None;
                self.run = 0;
                self.run_start = None;
                return None;
            }
            // On the line itself: neither a step towards a crossing nor away.
            Place::OnLine => return None,
            Place::Side(s) => s,
        };
        match self.settled {
            None => {
                self.settled = Some(side);
                None
            }
            Some(s) if s == side => {
                self.run = 0;
                self.run_start = None;
                None
            }
            Some(_) => {
                self.run += 1;
                let start = *self.run_start.get_or_insert(at);
                if self.run < line.inertia {
                    return None;
                }
                self.settled = Some(side);
                self.run = 0;
                self.run_start = None;
                let dir = match side {
                    Side::Right => Direction::In,
                    Side::Left => Direction::Out,
                };
                let counted = match dir {
                    Direction::In => &mut self.counted_in,
                    Direction::Out => &mut self.counted_out,
                };
                if *counted {
                    return None;
                }
                *counted = true;
                Some((dir, start))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    fn t(frame: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(frame * 100)
    }

    fn zone(inertia: u32, loiter: Option<Duration>) -> Zone {
        Zone::new(&ZoneConfig {
            name: "yard".into(),
            polygon: vec![[0.0, 240.0], [640.0, 240.0], [640.0, 480.0], [0.0, 480.0]],
            inertia,
            loiter,
            classes: vec!["car".into()],
            ..ZoneConfig::default()
        })
    }

    fn line(inertia: u32) -> Line {
        Line::new(&LineConfig {
            name: "gate".into(),
            points: [[320.0, 0.0], [320.0, 480.0]],
            inertia,
            ..LineConfig::default()
        })
    }

    #[test]
    fn zone_entry_waits_for_inertia_and_dates_from_the_first_frame() {
        let z = zone(3, None);
        let mut s = ZoneState::default();
        let out = Point::new(100.0, 100.0);
        let inn = Point::new(100.0, 300.0);
        assert_eq!(s.step(&z, out, t(0)), None);
        assert_eq!(s.step(&z, inn, t(1)), None);
        assert_eq!(s.step(&z, inn, t(2)), None);
        assert_eq!(s.step(&z, inn, t(3)), Some(ZoneChange::Enter { at: t(1) }));
        assert!(s.inside());
        // Flicker out for fewer than inertia frames: nothing.
        assert_eq!(s.step(&z, out, t(4)), None);
        assert_eq!(s.step(&z, out, t(5)), None);
        assert_eq!(s.step(&z, inn, t(6)), None);
        // Leave for good.
        for f in 7..9 {
            assert_eq!(s.step(&z, out, t(f)), None);
        }
        assert_eq!(
            s.step(&z, out, t(9)),
            Some(ZoneChange::Leave {
                at: t(7),
                dwell: Duration::from_millis(600)
            })
        );
        assert!(z.counts("car") && !z.counts("person"));
    }

    #[test]
    fn loiter_fires_once_per_visit() {
        let z = zone(1, Some(Duration::from_secs(1)));
        let mut s = ZoneState::default();
        let inn = Point::new(10.0, 300.0);
        let mut loiters = 0;
        for f in 0..40 {
            if let Some(ZoneChange::Loiter { dwell }) = s.step(&z, inn, t(f)) {
                assert_eq!(dwell, Duration::from_secs(1));
                assert_eq!(f, 10);
                loiters += 1;
            }
        }
        assert_eq!(loiters, 1);
        assert!(matches!(
            s.step(&z, Point::new(10.0, 10.0), t(41)),
            Some(ZoneChange::Leave { .. })
        ));
        let mut again = 0;
        for f in 42..60 {
            if let Some(ZoneChange::Loiter { .. }) = s.step(&z, inn, t(f)) {
                again += 1;
            }
        }
        assert_eq!(again, 1, "a new visit loiters again");
    }

    #[test]
    fn a_crossing_counts_with_its_direction_and_first_frame() {
        let l = line(2);
        let mut s = LineState::default();
        let mut got = Vec::new();
        for f in 0..20u64 {
            let p = Point::new(280.0 + f as f32 * 5.0, 240.0);
            if let Some(c) = s.step(&l, p, 2.0, t(f)) {
                got.push((f, c));
            }
        }
        // x = 325 (frame 9) is the first point past the margin on the right.
        assert_eq!(got, vec![(10, (Direction::In, t(9)))]);
        // And back: out.
        let mut back = Vec::new();
        for f in 20..40u64 {
            let p = Point::new(400.0 - (f - 20) as f32 * 10.0, 240.0);
            if let Some(c) = s.step(&l, p, 2.0, t(f)) {
                back.push(c.0);
            }
        }
        assert_eq!(back, vec![Direction::Out]);
    }

    #[test]
    fn jitter_on_the_line_is_one_crossing_at_most() {
        let l = line(2);
        let mut s = LineState::default();
        let mut got = Vec::new();
        // A 100 px high box: start left, jitter +-6 px around the line for
        // 100 frames, a different phase each frame, then leave to the right.
        let margin = line_margin(&[0.0, 140.0, 40.0, 240.0]);
        assert_eq!(margin, 10.0);
        for f in 0..5u64 {
            got.extend(s.step(&l, Point::new(300.0, 240.0), margin, t(f)));
        }
        for f in 5..105u64 {
            let dx = [-6.0, 6.0, 5.0, -5.0, 6.0, 6.0, -6.0, -6.0, 1.0][(f % 9) as usize];
            got.extend(s.step(&l, Point::new(320.0 + dx, 240.0), margin, t(f)));
        }
        for f in 105..115u64 {
            got.extend(s.step(&l, Point::new(360.0, 240.0), margin, t(f)));
        }
        assert_eq!(got, vec![(Direction::In, t(105))]);
        // Once per direction, however often it goes back and forth.
        let mut s2 = LineState::default();
        let mut dirs = Vec::new();
        for f in 0..200u64 {
            let x = if (f / 3) % 2 == 0 { 300.0 } else { 340.0 };
            if let Some((d, _)) = s2.step(&l, Point::new(x, 240.0), 2.0, t(f)) {
                dirs.push(d);
            }
        }
        assert_eq!(dirs, vec![Direction::In, Direction::Out]);
    }

    #[test]
    fn after_asks_for_the_other_zone_first() {
        let mut z = zone(1, None);
        assert!(came_from(&z, &[]), "no `after`: every track");
        z.after = Some(2);
        assert!(!came_from(&z, &[]));
        assert!(!came_from(&z, &[0, 1]));
        assert!(came_from(&z, &[1, 2]));
    }

    #[test]
    fn direction_filters_allow_their_side() {
        assert!(Directions::Both.allows(Direction::In) && Directions::Both.allows(Direction::Out));
        assert!(Directions::In.allows(Direction::In) && !Directions::In.allows(Direction::Out));
        assert!(Directions::Out.allows(Direction::Out) && !Directions::Out.allows(Direction::In));
    }

    #[test]
    fn going_around_the_end_is_no_crossing() {
        let l = line(1);
        let mut s = LineState::default();
        let path = [
            Point::new(300.0, 400.0),
            Point::new(300.0, 500.0), // below the end
            Point::new(340.0, 500.0),
            Point::new(340.0, 400.0), // right side, never crossed the segment
        ];
        for (f, p) in path.into_iter().enumerate() {
            assert_eq!(s.step(&l, p, 2.0, t(f as u64)), None, "frame {f}");
        }
    }
}
