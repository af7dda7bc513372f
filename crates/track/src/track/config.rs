//! `[pipelines.track]`, `[[pipelines.zones]]`, `[[pipelines.lines]]` and
//! `emit`: what a pipeline's tracking is told, with named defaults and one
//! `validate` that reports every problem.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::events::Direction;
use super::geometry::{self, Point};
use super::speed::{GroundPlane, SpeedUnit};

fn default_min_hits() -> u32 {
    3
}
fn default_max_age() -> Duration {
    Duration::from_secs(1)
}
fn default_iou() -> f32 {
    0.3
}
fn default_high_score() -> f32 {
    0.5
}
fn default_occluded_max_age() -> Duration {
    Duration::from_secs(3)
}
fn default_stationary_after() -> Duration {
    Duration::from_secs(10)
}
fn default_stationary_max_age() -> Duration {
    Duration::from_secs(600)
}
fn default_max_tracks() -> usize {
    256
}
fn default_snapshot_bytes() -> u64 {
    16 << 20
}
fn default_snapshot_max_bytes() -> usize {
    20_000
}
fn default_inertia() -> u32 {
    3
}
fn default_line_inertia() -> u32 {
    2
}
/// The most vertices a zone may have: the per-frame cost is linear in it.
pub const MAX_POLYGON_POINTS: usize = 64;

/// What reaches the outbox of a pipeline that tracks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Emit {
    /// One record per frame, as without tracking (with track ids in it).
    Frames,
    /// Only what happened: `track_start`, `zone_enter`, `line_cross`, ...
    /// (the default when `track` is set).
    #[default]
    Events,
}

/// Which crossings a line counts, which of entering (`in`) and leaving
/// (`out`) a zone tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Directions {
    In,
    Out,
    #[default]
    Both,
}

impl Directions {
    pub fn allows(self, d: Direction) -> bool {
        match self {
            Directions::Both => true,
            Directions::In => d == Direction::In,
            Directions::Out => d == Direction::Out,
        }
    }

    fn is_both(&self) -> bool {
        *self == Directions::Both
    }
}

/// `[pipelines.track]`: multi-object tracking per stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrackConfig {
    /// Frames a new object must be matched in before its track is announced
    /// (`track_start`) and carries an id; one-frame false detections never are.
    #[serde(default = "default_min_hits")]
    pub min_hits: u32,
    /// An object not matched for this long ends (`track_end`).
    #[serde(default = "default_max_age", with = "humantime_serde")]
    pub max_age: Duration,
    /// An object lost where another object's box covers the place it
    /// should be by now (hidden behind it) coasts along its motion this
    /// long instead of `max_age` (the longer of the two), so it keeps its
    /// id when it comes out again.
    #[serde(default = "default_occluded_max_age", with = "humantime_serde")]
    pub occluded_max_age: Duration,
    /// Intersection over union a detection needs with a track's predicted
    /// box to continue it.
    #[serde(default = "default_iou")]
    pub iou: f32,
    /// Detections scoring at least this may start tracks; they and those
    /// down to 0.1 below are matched first (IoU at least `iou`), weaker
    /// ones only continue tracks in a second pass (IoU at least 0.5;
    /// ByteTrack).
    #[serde(default = "default_high_score")]
    pub high_score: f32,
    /// An object whose box stays put (within a tenth of its height) this long
    /// is stationary: a parked vehicle.
    #[serde(default = "default_stationary_after", with = "humantime_serde")]
    pub stationary_after: Duration,
    /// How long a stationary object's track survives missed detections:
    /// when it is seen again at its place it keeps its id and is not
    /// announced again.
    #[serde(default = "default_stationary_max_age", with = "humantime_serde")]
    pub stationary_max_age: Duration,
    /// Open tracks per stream, at most; past it the longest unseen one ends
    /// early (reason `evicted`).
    #[serde(default = "default_max_tracks")]
    pub max_tracks: usize,
    /// The best crops of the pipeline's tracks on disk, all of them within
    /// this many bytes (the least recently written go first); 0: none kept.
    /// Crops come from pipelines that decode their frames (with stages).
    #[serde(default = "default_snapshot_bytes", with = "crate::bytesize")]
    pub snapshot_bytes: u64,
    /// One crop's JPEG at most (lower quality, then smaller, until it fits).
    #[serde(
        default = "default_snapshot_max_bytes",
        with = "crate::bytesize::usize"
    )]
    pub snapshot_max_bytes: usize,
}

impl Default for TrackConfig {
    fn default() -> Self {
        TrackConfig {
            min_hits: default_min_hits(),
            max_age: default_max_age(),
            occluded_max_age: default_occluded_max_age(),
            iou: default_iou(),
            high_score: default_high_score(),
            stationary_after: default_stationary_after(),
            stationary_max_age: default_stationary_max_age(),
            max_tracks: default_max_tracks(),
            snapshot_bytes: default_snapshot_bytes(),
            snapshot_max_bytes: default_snapshot_max_bytes(),
        }
    }
}

/// `[[pipelines.zones]]`: a polygon in source-frame pixels; an object is in
/// it when the bottom centre of its box is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ZoneConfig {
    /// Names the zone in events, metrics and the status.
    pub name: String,
    /// Vertices `[x, y]` in order (at least 3, edges not crossing).
    pub polygon: Vec<[f32; 2]>,
    /// Consecutive frames in (or out) before `zone_enter` (or `zone_leave`):
    /// a box flickering on the edge does not enter and leave every frame.
    #[serde(default = "default_inertia")]
    pub inertia: u32,
    /// An object staying this long gets one `loiter` event per visit.
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub loiter: Option<Duration>,
    /// Labels this zone counts (empty: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<String>,
    /// The camera whose frames the zone is on, in a pipeline reading
    /// several (`cameras = [...]`), where it is required; absent: every stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub camera: Option<String>,
    /// Count the objects of each label in the zone: `zone_occupancy`
    /// events when a count changed and held for `inertia` frames, a gauge
    /// in `/metrics`, the counts in `/v1/status`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub occupancy: bool,
    /// Which of `zone_enter` (`in`) and `zone_leave` (`out`) are told.
    #[serde(default, skip_serializing_if = "Directions::is_both")]
    pub direction: Directions,
    /// Another zone's name: only tracks that were in that zone before
    /// entering this one count here (`zone_enter`, `zone_leave`, `loiter`,
    /// speed); others pass unannounced (occupancy still counts them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// The real lengths of the four sides of a zone of 4 points, from point
    /// 0 to 1, 1 to 2, 2 to 3 and 3 to 0 (metres; feet with `speed_unit =
    /// "mph"`): the zone is a rectangle on the ground and tracks in it get
    /// a `speed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distances: Option<[f32; 4]>,
    /// `km/h` (the default), `mph` or `m/s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed_unit: Option<SpeedUnit>,
    /// A track faster than this (in `speed_unit`) in the zone gets one
    /// `speeding` event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed_limit: Option<f32>,
}

impl Default for ZoneConfig {
    /// A zone with every optional key at its default (name and polygon empty).
    fn default() -> Self {
        ZoneConfig {
            name: String::new(),
            polygon: Vec::new(),
            inertia: default_inertia(),
            loiter: None,
            classes: Vec::new(),
            occupancy: false,
            direction: Directions::Both,
            after: None,
            distances: None,
            speed_unit: None,
            speed_limit: None,
            camera: None,
        }
    }
}

/// `[[pipelines.lines]]`: two points; an object crosses when the bottom
/// centre of its box goes from one side to the other within the segment.
/// With the image turned so that the first point is at the top and the
/// second at the bottom, crossing from the left to the right is `in`, the
/// other way `out`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LineConfig {
    pub name: String,
    /// `[[x1, y1], [x2, y2]]` in source-frame pixels: exactly two points of
    /// two numbers each (a third point is refused, never dropped).
    #[serde(deserialize_with = "two_points")]
    pub points: [[f32; 2]; 2],
    /// Consecutive frames on the new side before a crossing counts; with the
    /// rule that a track counts once per line and direction, a box
    /// jittering on the line is one crossing at most.
    #[serde(default = "default_line_inertia")]
    pub inertia: u32,
    /// Labels this line counts (empty: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<String>,
    /// As a zone's `camera`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub camera: Option<String>,
    /// Which crossings count: `in`, `out` or `both` (the default).
    #[serde(default, skip_serializing_if = "Directions::is_both")]
    pub direction: Directions,
}

impl Default for LineConfig {
    /// A line with every optional key at its default (name empty, points at 0).
    fn default() -> Self {
        LineConfig {
            name: String::new(),
            points: [[0.0; 2]; 2],
            inertia: default_line_inertia(),
            classes: Vec::new(),
            direction: Directions::Both,
            camera: None,
        }
    }
}

impl ZoneConfig {
    pub fn points(&self) -> Vec<Point> {
        self.polygon
            .iter()
            .map(|p| Point::new(p[0], p[1]))
            .collect()
    }

    /// The unit of the zone's speeds.
    pub fn unit(&self) -> SpeedUnit {
        self.speed_unit.unwrap_or_default()
    }

    /// The zone's ground plane, when it is calibrated.
    pub fn ground(&self) -> Option<Result<GroundPlane, super::speed::CalibrationError>> {
        let d = self.distances?;
        Some(GroundPlane::new(
            &self.points(),
            d,
            self.unit().metres_per_distance(),
        ))
    }
}

impl LineConfig {
    pub fn ends(&self) -> (Point, Point) {
        let [a, b] = self.points;
        (Point::new(a[0], a[1]), Point::new(b[0], b[1]))
    }
}

fn bad_name(name: &str) -> bool {
    name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn check_classes(p: &mut Vec<String>, at: &str, classes: &[String]) {
    if classes.iter().any(|c| c.is_empty()) {
        p.push(format!("{at}.classes: a label must not be empty"));
    }
}

/// Every problem with a pipeline's tracking tables, at once; `at` is the
/// pipeline's path in the config (`pipelines[0]`).
pub fn validate(
    at: &str,
    track: Option<&TrackConfig>,
    zones: &[ZoneConfig],
    lines: &[LineConfig],
    emit: Option<Emit>,
) -> Vec<String> {
    let mut p = Vec::new();
    if let Some(t) = track {
        p.extend(t.validate(&format!("{at}.track")));
    } else {
        if !zones.is_empty() {
            p.push(format!(
                "{at}.zones: zones need `[pipelines.track]` (objects are placed by their tracks)"
            ));
        }
        if !lines.is_empty() {
            p.push(format!(
                "{at}.lines: lines need `[pipelines.track]` (a crossing is a track's)"
            ));
        }
        if emit == Some(Emit::Events) {
            p.push(format!(
                "{at}.emit: `events` needs `[pipelines.track]` (events are a track's)"
            ));
        }
    }
    for (i, z) in zones.iter().enumerate() {
        let at = format!("{at}.zones[{i}]");
        if bad_name(&z.name) {
            p.push(format!(
                "{at}.name: `{}` must be 1-64 letters, digits, '_' or '-'",
                z.name
            ));
        } else if zones[..i].iter().any(|o| o.name == z.name) {
            p.push(format!("{at}.name: `{}` is used twice", z.name));
        }
        if z.polygon.len() > MAX_POLYGON_POINTS {
            p.push(format!(
                "{at}.polygon: {} points; at most {MAX_POLYGON_POINTS}",
                z.polygon.len()
            ));
        } else if let Err(e) = geometry::check_polygon(&z.points()) {
            p.push(format!("{at}.polygon: {e}"));
        }
        if z.inertia == 0 || z.inertia > 1000 {
            p.push(format!(
                "{at}.inertia: {} is out of range 1..=1000",
                z.inertia
            ));
        }
        if z.loiter.is_some_and(|d| d.is_zero()) {
            p.push(format!("{at}.loiter: must be longer than 0s"));
        }
        check_classes(&mut p, &at, &z.classes);
        check_analytics(&mut p, &at, zones, i);
    }
    for (i, l) in lines.iter().enumerate() {
        let at = format!("{at}.lines[{i}]");
        if bad_name(&l.name) {
            p.push(format!(
                "{at}.name: `{}` must be 1-64 letters, digits, '_' or '-'",
                l.name
            ));
        } else if lines[..i].iter().any(|o| o.name == l.name) {
            p.push(format!("{at}.name: `{}` is used twice", l.name));
        }
        let (a, b) = l.ends();
        if !(a.is_finite() && b.is_finite()) {
            p.push(format!("{at}.points: coordinates must be finite numbers"));
        } else if a.distance(b) < 1.0 {
            p.push(format!(
                "{at}.points: the two points must be at least 1 px apart"
            ));
        }
        if l.inertia == 0 || l.inertia > 1000 {
            p.push(format!(
                "{at}.inertia: {} is out of range 1..=1000",
                l.inertia
            ));
        }
        check_classes(&mut p, &at, &l.classes);
    }
    p
}

/// The `camera` of each zone and line of a pipeline whose streams are
/// `cameras` (`None`: its streams are not cameras): required, and one of
/// them, where it reads more than one; one of them where it reads one;
/// refused where its streams are not cameras.
pub fn validate_cameras(
    at: &str,
    cameras: &Option<Vec<String>>,
    zones: &[ZoneConfig],
    lines: &[LineConfig],
) -> Vec<String> {
    let mut p = Vec::new();
    let items = zones
        .iter()
        .enumerate()
        .map(|(i, z)| (format!("{at}.zones[{i}]"), "zone", &z.name, &z.camera))
        .chain(
            lines
                .iter()
                .enumerate()
                .map(|(i, l)| (format!("{at}.lines[{i}]"), "line", &l.name, &l.camera)),
        );
    for (at, what, name, camera) in items {
        match (cameras, camera) {
            (None, Some(c)) => p.push(format!(
                "{at}.camera: `{c}`: `camera` names one of the pipeline's `cameras`, and this pipeline reads none"
            )),
            (Some(list), None) if list.len() > 1 => p.push(format!(
                "{at}.camera: the pipeline reads {} cameras ({}): say which one {what} `{name}` is on",
                list.len(),
                list.join(", ")
            )),
            (Some(list), Some(c)) if !list.contains(c) => p.push(format!(
                "{at}.camera: `{c}` is not one of the pipeline's cameras ({})",
                list.join(", ")
            )),
            _ => {}
        }
    }
    p
}

/// `after`, `distances`, `speed_unit` and `speed_limit` of zone `i`.
fn check_analytics(p: &mut Vec<String>, at: &str, zones: &[ZoneConfig], i: usize) {
    let z = &zones[i];
    if let Some(a) = &z.after {
        if *a == z.name {
            p.push(format!("{at}.after: a zone cannot come after itself"));
        } else if !zones.iter().any(|o| o.name == *a) {
            p.push(format!("{at}.after: no zone is named `{a}`"));
        } else if after_depth(zones, i).is_none() {
            p.push(format!(
                "{at}.after: `{a}` leads back to `{}` (zones in a circle)",
                z.name
            ));
        }
    }
    match z.ground() {
        Some(Err(e)) => p.push(format!("{at}.distances: {e}")),
        Some(Ok(_)) => {
            // One unit per pipeline: `max_speed` of `track_end` is the
            // fastest over all of its zones.
            if let Some(first) = zones[..i].iter().find(|o| o.distances.is_some())
                && first.unit() != z.unit()
            {
                p.push(format!(
                    "{at}.speed_unit: `{}` differs from zone `{}`'s `{}`; a pipeline's speeds share one unit",
                    z.unit().as_str(),
                    first.name,
                    first.unit().as_str()
                ));
            }
        }
        None => {
            if z.speed_unit.is_some() {
                p.push(format!(
                    "{at}.speed_unit: needs `distances` (the zone's calibration)"
                ));
            }
            if z.speed_limit.is_some() {
                p.push(format!(
                    "{at}.speed_limit: needs `distances` (the zone's calibration)"
                ));
            }
        }
    }
    if let Some(l) = z.speed_limit
        && !(l.is_finite() && l > 0.0)
    {
        p.push(format!("{at}.speed_limit: {l} must be a number above 0"));
    }
}

/// How many zones precede zone `i` by `after` (0: none); `None` when the
/// chain comes back to a zone it passed, or names no zone.
pub fn after_depth(zones: &[ZoneConfig], i: usize) -> Option<usize> {
    let mut seen = vec![i];
    let mut at = i;
    while let Some(a) = &zones[at].after {
        at = zones.iter().position(|o| o.name == *a)?;
        if seen.contains(&at) {
            return None;
        }
        seen.push(at);
    }
    Some(seen.len() - 1)
}

impl TrackConfig {
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        if self.min_hits == 0 || self.min_hits > 1000 {
            p.push(format!(
                "{at}.min_hits: {} is out of range 1..=1000",
                self.min_hits
            ));
        }
        if self.max_age.is_zero() {
            p.push(format!("{at}.max_age: must be longer than 0s"));
        }
        if !(self.iou > 0.0 && self.iou <= 1.0) {
            p.push(format!("{at}.iou: {} must be in (0, 1]", self.iou));
        }
        if !(0.0..=1.0).contains(&self.high_score) {
            p.push(format!(
                "{at}.high_score: {} must be in 0..=1",
                self.high_score
            ));
        }
        if self.stationary_after.is_zero() {
            p.push(format!("{at}.stationary_after: must be longer than 0s"));
        }
        if self.stationary_max_age < self.max_age {
            p.push(format!(
                "{at}.stationary_max_age: must not be shorter than max_age"
            ));
        }
        if self.snapshot_max_bytes < 1000 {
            p.push(format!(
                "{at}.snapshot_max_bytes: {} is below 1000 bytes",
                self.snapshot_max_bytes
            ));
        }
        if self.max_tracks == 0 || self.max_tracks > 100_000 {
            p.push(format!(
                "{at}.max_tracks: {} is out of range 1..=100000",
                self.max_tracks
            ));
        }
        p
    }
}

/// A line's `points`: exactly two points of two numbers each. Serde's fixed
/// arrays take the first two of a longer list and drop the rest: a line
/// drawn with three points would count on a segment the user did not draw.
fn two_points<'de, D: serde::Deserializer<'de>>(d: D) -> Result<[[f32; 2]; 2], D::Error> {
    use serde::de::Error;
    let v: Vec<Vec<f32>> = Vec::deserialize(d)?;
    let point = |p: &Vec<f32>| -> Result<[f32; 2], D::Error> {
        match p.as_slice() {
            [x, y] => Ok([*x, *y]),
            _ => Err(D::Error::custom(format!(
                "a point is [x, y]; this one has {} numbers",
                p.len()
            ))),
        }
    };
    match v.as_slice() {
        [a, b] => Ok([point(a)?, point(b)?]),
        _ => Err(D::Error::custom(format!(
            "a line has exactly two points, [[x1, y1], [x2, y2]]; this one has {}",
            v.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct P {
        #[serde(default)]
        emit: Option<Emit>,
        #[serde(default)]
        track: Option<TrackConfig>,
        #[serde(default)]
        zones: Vec<ZoneConfig>,
        #[serde(default)]
        lines: Vec<LineConfig>,
    }

    fn parse(s: &str) -> P {
        toml::from_str(s).unwrap()
    }

    fn problems(p: &P) -> Vec<String> {
        validate("p", p.track.as_ref(), &p.zones, &p.lines, p.emit)
    }

    #[test]
    fn the_issue_example_parses_with_defaults() {
        let p = parse(
            r#"
emit = "events"
[track]
min_hits = 3
max_age = "1s"
iou = 0.3
[[zones]]
name = "yard"
polygon = [[0, 240], [640, 240], [640, 480], [0, 480]]
inertia = 3
loiter = "30s"
[[lines]]
name = "gate"
points = [[320, 0], [320, 480]]
"#,
        );
        assert_eq!(p.emit, Some(Emit::Events));
        let t = p.track.as_ref().unwrap();
        assert_eq!(t, &TrackConfig::default());
        assert_eq!(p.zones[0].loiter, Some(Duration::from_secs(30)));
        assert!(p.zones[0].classes.is_empty());
        assert_eq!(p.lines[0].inertia, 2);
        assert!(problems(&p).is_empty(), "{:?}", problems(&p));
    }

    #[test]
    fn unknown_keys_are_refused() {
        assert!(toml::from_str::<P>("[track]\nmin_hit = 3").is_err());
        assert!(toml::from_str::<P>("[[zones]]\nname = \"a\"\npolygon = []\ninertai = 2").is_err());
        assert!(toml::from_str::<P>("emit = \"everything\"").is_err());
    }

    #[test]
    fn an_invalid_polygon_is_reported_with_its_path() {
        let p = parse(
            r#"
[track]
[[zones]]
name = "bow"
polygon = [[0, 0], [100, 100], [100, 0], [0, 100]]
[[zones]]
name = "flat"
polygon = [[0, 0], [50, 50], [100, 100]]
[[zones]]
name = "two"
polygon = [[0, 0], [50, 50]]
"#,
        );
        let e = problems(&p);
        assert_eq!(e.len(), 3, "{e:?}");
        assert!(e[0].starts_with("p.zones[0].polygon: "), "{e:?}");
        assert!(e[0].contains("cross"), "{e:?}");
        assert!(e[1].contains("area"), "{e:?}");
        assert!(e[2].contains("at least 3"), "{e:?}");
    }

    #[test]
    fn every_problem_at_once() {
        let p = parse(
            r#"
emit = "events"
[track]
min_hits = 0
max_age = "0s"
iou = 0.0
high_score = 1.5
max_tracks = 0
stationary_after = "0s"
[[zones]]
name = "a b"
polygon = [[0, 0], [10, 0], [10, 10]]
inertia = 0
loiter = "0s"
classes = [""]
[[lines]]
name = "l"
points = [[5, 5], [5, 5]]
[[lines]]
name = "l"
points = [[0, 0], [0, 10]]
inertia = 0
"#,
        );
        let e = problems(&p);
        // track: min_hits, max_age, iou, high_score, stationary_after,
        // stationary_max_age < max_age? (no: 600s >= 0s), max_tracks = 6;
        // zone: name, inertia, loiter, classes = 4; lines: points, name twice, inertia = 3.
        assert_eq!(e.len(), 13, "{e:#?}");
    }

    #[test]
    fn analytics_keys_parse_and_default_to_none() {
        let p = parse(
            r#"
[track]
[[zones]]
name = "street"
polygon = [[0, 0], [100, 0], [100, 100], [0, 100]]
distances = [10, 20, 10, 20]
speed_unit = "mph"
speed_limit = 25
occupancy = true
direction = "in"
[[zones]]
name = "drive"
polygon = [[100, 0], [200, 0], [200, 100]]
after = "street"
[[lines]]
name = "gate"
points = [[0, 0], [0, 10]]
direction = "out"
"#,
        );
        assert!(problems(&p).is_empty(), "{:?}", problems(&p));
        let z = &p.zones[0];
        assert_eq!(z.distances, Some([10.0, 20.0, 10.0, 20.0]));
        assert_eq!(z.unit(), SpeedUnit::Mph);
        assert!(z.occupancy && z.direction == Directions::In);
        assert_eq!(p.zones[1].after.as_deref(), Some("street"));
        assert!(!p.zones[1].occupancy && p.zones[1].direction == Directions::Both);
        assert_eq!(p.zones[1].unit(), SpeedUnit::KmH);
        assert_eq!(p.lines[0].direction, Directions::Out);
        assert!(
            toml::from_str::<P>(
                "[[lines]]\nname = \"l\"\npoints = [[0, 0], [0, 9]]\ndirection = \"up\""
            )
            .is_err()
        );
        assert!(
            toml::from_str::<P>("[[zones]]\nname = \"z\"\npolygon = []\nspeed_unit = \"kmh\"")
                .is_err()
        );
    }

    #[test]
    fn every_analytics_problem_at_once_with_its_path() {
        let p = parse(
            r#"
[track]
[[zones]]
name = "a"
polygon = [[0, 0], [100, 0], [100, 100]]
distances = [10, 10, 10, 10]
[[zones]]
name = "b"
polygon = [[0, 0], [100, 0], [100, 100], [0, 100]]
distances = [10, 0, 10, 10]
after = "b"
[[zones]]
name = "c"
polygon = [[0, 0], [10, 0], [3, 3], [0, 10]]
distances = [1, 1, 1, 1]
after = "nowhere"
[[zones]]
name = "d"
polygon = [[0, 0], [10, 0], [10, 10], [0, 10]]
speed_limit = -3
speed_unit = "m/s"
after = "e"
[[zones]]
name = "e"
polygon = [[0, 0], [10, 0], [10, 10], [0, 10]]
after = "d"
[[zones]]
name = "f"
polygon = [[0, 0], [10, 0], [10, 10], [0, 10]]
distances = [1, 1, 1, 1]
speed_unit = "mph"
[[zones]]
name = "g"
polygon = [[0, 0], [10, 0], [10, 10], [0, 10]]
distances = [1, 1, 1, 1]
[[zones]]
name = "h"
polygon = [[0, 0], [10, 0], [10, 10], [0, 10]]
distances = [1e-7, 1e-7, 1e-7, 1e-7]
"#,
        );
        let e = problems(&p);
        let want = [
            "p.zones[0].distances: a calibrated zone needs exactly 4 polygon points (its corners), not 3",
            "p.zones[1].after: a zone cannot come after itself",
            "p.zones[1].distances: distance 1 is 0; each must be a finite number above 0",
            "p.zones[2].after: no zone is named `nowhere`",
            "p.zones[2].distances: the 4 corners must make a convex quadrilateral (a rectangle on the ground)",
            "p.zones[3].after: `e` leads back to `d` (zones in a circle)",
            "p.zones[3].speed_unit: needs `distances` (the zone's calibration)",
            "p.zones[3].speed_limit: needs `distances` (the zone's calibration)",
            "p.zones[3].speed_limit: -3 must be a number above 0",
            "p.zones[4].after: `d` leads back to `e` (zones in a circle)",
            "p.zones[5].speed_unit: `mph` differs from zone `a`'s `km/h`; a pipeline's speeds share one unit",
            "p.zones[7].distances: distance 0 is 0.0000001: too small to calibrate a zone; each side must be at least 0.001 (metres, or feet for mph)",
        ];
        assert_eq!(e, want, "{e:#?}");
    }

    #[test]
    fn zones_lines_and_events_need_a_track() {
        let p = parse(
            r#"
emit = "events"
[[zones]]
name = "a"
polygon = [[0, 0], [10, 0], [10, 10]]
[[lines]]
name = "l"
points = [[0, 0], [0, 10]]
"#,
        );
        let e = problems(&p);
        assert_eq!(e.len(), 3, "{e:?}");
        assert!(e.iter().all(|m| m.contains("need")), "{e:?}");
        let frames = parse("emit = \"frames\"");
        assert!(problems(&frames).is_empty());
    }
}
