//! Speed in a calibrated zone, as Frigate measures it: the zone's four
//! corners are a rectangle marked on the ground whose sides' real lengths
//! are known, so a homography maps a box's bottom centre in the picture to
//! metres on the ground, and a track's speed is the slope of its ground
//! positions over the last second.
//!
//! Invariants:
//! - a [`GroundPlane`] exists only for a convex quadrilateral whose corners
//!   map exactly onto the rectangle (checked when it is built);
//! - an estimate needs [`MIN_SAMPLES`] frames; one spanning less than
//!   [`SETTLED`] is given in events but never raises `max_speed` or fires
//!   `speeding` (three frames of a jittering box are no speed limit breach).

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::geometry::Point;

/// How far back the speed is measured.
pub const WINDOW: Duration = Duration::from_secs(1);
/// Frames kept per track and zone, at most (a second at 30 fps and some).
pub const MAX_SAMPLES: usize = 32;
/// Frames an estimate needs: two give a speed, three average the jitter.
pub const MIN_SAMPLES: usize = 3;
/// An estimate over at least this long may raise `max_speed` and `speeding`.
pub const SETTLED: Duration = Duration::from_millis(500);

/// The unit speeds are told in; the zone's `distances` are metres for
/// `km/h` and `m/s`, feet for `mph`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum SpeedUnit {
    #[default]
    #[serde(rename = "km/h")]
    KmH,
    #[serde(rename = "mph")]
    Mph,
    #[serde(rename = "m/s")]
    Ms,
}

impl SpeedUnit {
    pub fn as_str(self) -> &'static str {
        match self {
            SpeedUnit::KmH => "km/h",
            SpeedUnit::Mph => "mph",
            SpeedUnit::Ms => "m/s",
        }
    }

    /// Metres in one unit of the zone's `distances`.
    pub fn metres_per_distance(self) -> f64 {
        match self {
            SpeedUnit::KmH | SpeedUnit::Ms => 1.0,
            SpeedUnit::Mph => 0.3048,
        }
    }

    /// A speed in metres per second in this unit.
    pub fn from_mps(self, mps: f64) -> f64 {
        match self {
            SpeedUnit::KmH => mps * 3.6,
            SpeedUnit::Ms => mps,
            SpeedUnit::Mph => mps / 0.44704,
        }
    }
}

/// A 3x3 projective map, row-major (known only up to scale).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Homography([f64; 9]);

impl Homography {
    /// The map taking each `src[i]` to `dst[i]`; `None` when three of
    /// either are on one line (no such map). Composed of the closed-form
    /// maps from the unit square (Heckbert), which, unlike solving for
    /// eight unknowns with the ninth set to 1, holds when the picture's
    /// origin lies on the ground's horizon.
    pub fn from_points(src: [(f64, f64); 4], dst: [(f64, f64); 4]) -> Option<Self> {
        let s = square_to_quad(src)?;
        let d = square_to_quad(dst)?;
        let m = Homography(mul(&d, &adjugate(&s)));
        // Exact at the corners, or the points were (nearly) degenerate.
        let scale = dst
            .iter()
            .fold(1.0f64, |a, (u, v)| a.max(u.abs()).max(v.abs()));
        for ((x, y), (u, v)) in src.into_iter().zip(dst) {
            let (mu, mv) = m.map_xy(x, y)?;
            if (mu - u).abs() > 1e-6 * scale || (mv - v).abs() > 1e-6 * scale {
                return None;
            }
        }
        Some(m)
    }

    fn map_xy(&self, x: f64, y: f64) -> Option<(f64, f64)> {
        let h = &self.0;
        let w = h[6] * x + h[7] * y + h[8];
        let (u, v) = (
            (h[0] * x + h[1] * y + h[2]) / w,
            (h[3] * x + h[4] * y + h[5]) / w,
        );
        (u.is_finite() && v.is_finite()).then_some((u, v))
    }

    pub fn map(&self, p: Point) -> Option<(f64, f64)> {
        self.map_xy(f64::from(p.x), f64::from(p.y))
    }
}

/// The projective map of the unit square's corners (0,0), (1,0), (1,1),
/// (0,1) onto `q` (Heckbert, "Fundamentals of Texture Mapping", 1989).
fn square_to_quad(q: [(f64, f64); 4]) -> Option<[f64; 9]> {
    let [(x0, y0), (x1, y1), (x2, y2), (x3, y3)] = q;
    let (sx, sy) = (x0 - x1 + x2 - x3, y0 - y1 + y2 - y3);
    let (g, h) = if sx == 0.0 && sy == 0.0 {
        (0.0, 0.0)
    } else {
        let (dx1, dx2, dy1, dy2) = (x1 - x2, x3 - x2, y1 - y2, y3 - y2);
        let den = dx1 * dy2 - dx2 * dy1;
        if den.abs() < 1e-12 {
            return None;
        }
        ((sx * dy2 - dx2 * sy) / den, (dx1 * sy - sx * dy1) / den)
    };
    let m = [
        x1 - x0 + g * x1,
        x3 - x0 + h * x3,
        x0,
        y1 - y0 + g * y1,
        y3 - y0 + h * y3,
        y0,
        g,
        h,
        1.0,
    ];
    let det = m[0] * (m[4] * m[8] - m[5] * m[7]) - m[1] * (m[3] * m[8] - m[5] * m[6])
        + m[2] * (m[3] * m[7] - m[4] * m[6]);
    (det.abs() > 1e-12 && det.is_finite()).then_some(m)
}

/// The inverse up to scale.
fn adjugate(m: &[f64; 9]) -> [f64; 9] {
    [
        m[4] * m[8] - m[5] * m[7],
        m[2] * m[7] - m[1] * m[8],
        m[1] * m[5] - m[2] * m[4],
        m[5] * m[6] - m[3] * m[8],
        m[0] * m[8] - m[2] * m[6],
        m[2] * m[3] - m[0] * m[5],
        m[3] * m[7] - m[4] * m[6],
        m[1] * m[6] - m[0] * m[7],
        m[0] * m[4] - m[1] * m[3],
    ]
}

fn mul(a: &[f64; 9], b: &[f64; 9]) -> [f64; 9] {
    let mut c = [0f64; 9];
    for r in 0..3 {
        for k in 0..3 {
            c[r * 3 + k] = (0..3).map(|j| a[r * 3 + j] * b[j * 3 + k]).sum();
        }
    }
    c
}

/// The shortest side a calibration takes, in the zone's unit (metres, or
/// feet for `mph`): a millimetre. Shorter sides are no marking on the
/// ground, and a rectangle of them is too small for the map's arithmetic
/// (its area vanishes next to the picture's), which would otherwise read as
/// corners that make no quadrilateral.
pub const MIN_DISTANCE: f32 = 0.001;

/// Why four corners and distances calibrate no zone.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CalibrationError {
    #[error("a calibrated zone needs exactly 4 polygon points (its corners), not {0}")]
    NotFour(usize),
    #[error("distance {0} is {1}; each must be a finite number above 0")]
    BadDistance(usize, f32),
    #[error(
        "distance {0} is {1}: too small to calibrate a zone; each side must be at least {MIN_DISTANCE} (metres, or feet for mph)"
    )]
    TooSmall(usize, f32),
    #[error("the 4 corners must make a convex quadrilateral (a rectangle on the ground)")]
    NotConvex,
}

/// A zone's ground: picture pixels to metres.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroundPlane {
    h: Homography,
}

impl GroundPlane {
    /// `corners` in the polygon's order, `distances[i]` the real length
    /// from corner `i` to corner `i + 1` (the last back to the first) in
    /// units of `metres_per_unit` metres. The corners are taken for a
    /// rectangle whose sides are the mean of each pair of opposite sides.
    pub fn new(
        corners: &[Point],
        distances: [f32; 4],
        metres_per_unit: f64,
    ) -> Result<Self, CalibrationError> {
        let [a, b, c, d] = corners else {
            return Err(CalibrationError::NotFour(corners.len()));
        };
        if let Some((i, v)) = distances
            .iter()
            .enumerate()
            .find(|(_, v)| !(v.is_finite() && **v > 0.0))
        {
            return Err(CalibrationError::BadDistance(i, *v));
        }
        if let Some((i, v)) = distances
            .iter()
            .enumerate()
            .find(|(_, v)| **v < MIN_DISTANCE)
        {
            return Err(CalibrationError::TooSmall(i, *v));
        }
        let q = [*a, *b, *c, *d];
        if !convex(&q) {
            return Err(CalibrationError::NotConvex);
        }
        let m = |v: f32| f64::from(v) * metres_per_unit;
        let width = (m(distances[0]) + m(distances[2])) / 2.0;
        let length = (m(distances[1]) + m(distances[3])) / 2.0;
        let src = q.map(|p| (f64::from(p.x), f64::from(p.y)));
        let dst = [(0.0, 0.0), (width, 0.0), (width, length), (0.0, length)];
        let h = Homography::from_points(src, dst).ok_or(CalibrationError::NotConvex)?;
        Ok(GroundPlane { h })
    }

    /// Where `p` stands on the ground, in metres.
    pub fn ground(&self, p: Point) -> Option<(f64, f64)> {
        self.h.map(p)
    }
}

/// All turns one way, none straight.
fn convex(q: &[Point; 4]) -> bool {
    let turn = |i: usize| {
        let (a, b, c) = (q[i], q[(i + 1) % 4], q[(i + 2) % 4]);
        f64::from(b.x - a.x) * f64::from(c.y - b.y) - f64::from(b.y - a.y) * f64::from(c.x - b.x)
    };
    let t = [turn(0), turn(1), turn(2), turn(3)];
    t.iter().all(|v| *v > 0.0) || t.iter().all(|v| *v < 0.0)
}

/// A speed estimate: metres per second over `span`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    pub mps: f64,
    pub span: Duration,
}

impl Estimate {
    pub fn settled(&self) -> bool {
        self.span >= SETTLED
    }
}

/// One track's ground positions in one zone over the last [`WINDOW`].
#[derive(Debug, Clone, Default)]
pub struct SpeedWindow {
    samples: VecDeque<(SystemTime, f64, f64)>,
}

impl SpeedWindow {
    pub fn push(&mut self, at: SystemTime, (x, y): (f64, f64)) {
        // Frames come in order; one out of order or twice is skipped
        // rather than dividing by a zero span.
        if self.samples.back().is_some_and(|s| s.0 >= at) {
            return;
        }
        while self.samples.len() >= MAX_SAMPLES
            || self
                .samples
                .front()
                .is_some_and(|s| at.duration_since(s.0).unwrap_or_default() > WINDOW)
        {
            self.samples.pop_front();
        }
        self.samples.push_back((at, x, y));
    }

    pub fn clear(&mut self) {
        self.samples.clear();
    }

    /// The least-squares velocity of the window (a line through every
    /// sample, not the two ends: one jittering box moves it little).
    pub fn estimate(&self) -> Option<Estimate> {
        let n = self.samples.len();
        if n < MIN_SAMPLES {
            return None;
        }
        let (t0, ..) = *self.samples.front()?;
        let (tn, ..) = *self.samples.back()?;
        let secs = |t: SystemTime| t.duration_since(t0).unwrap_or_default().as_secs_f64();
        let nf = n as f64;
        let (mut st, mut sx, mut sy) = (0.0, 0.0, 0.0);
        for &(t, x, y) in &self.samples {
            st += secs(t);
            sx += x;
            sy += y;
        }
        let (mt, mx, my) = (st / nf, sx / nf, sy / nf);
        let (mut stt, mut stx, mut sty) = (0.0, 0.0, 0.0);
        for &(t, x, y) in &self.samples {
            let dt = secs(t) - mt;
            stt += dt * dt;
            stx += dt * (x - mx);
            sty += dt * (y - my);
        }
        if stt <= 0.0 {
            return None;
        }
        let mps = (stx / stt).hypot(sty / stt);
        mps.is_finite().then(|| Estimate {
            mps,
            span: tn.duration_since(t0).unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    fn pts(v: &[[f32; 2]]) -> Vec<Point> {
        v.iter().map(|p| Point::new(p[0], p[1])).collect()
    }

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn a_rectangle_in_the_picture_scales_each_axis() {
        // 200 x 100 px for 10 m x 20 m: 0.05 m/px across, 0.2 m/px down.
        let g = GroundPlane::new(
            &pts(&[
                [100.0, 100.0],
                [300.0, 100.0],
                [300.0, 200.0],
                [100.0, 200.0],
            ]),
            [10.0, 20.0, 10.0, 20.0],
            1.0,
        )
        .unwrap();
        let (x, y) = g.ground(Point::new(200.0, 150.0)).unwrap();
        assert!(close(x, 5.0, 1e-9) && close(y, 10.0, 1e-9), "{x} {y}");
        let (x, y) = g.ground(Point::new(300.0, 200.0)).unwrap();
        assert!(close(x, 10.0, 1e-9) && close(y, 20.0, 1e-9), "{x} {y}");
    }

    #[test]
    fn a_trapezoid_in_perspective_maps_onto_its_rectangle() {
        // A road 8 m wide seen from above its near end: 400 px wide at the
        // bottom, 100 px at the top 30 m away.
        let corners = pts(&[
            [250.0, 100.0],
            [350.0, 100.0],
            [500.0, 400.0],
            [100.0, 400.0],
        ]);
        let g = GroundPlane::new(&corners, [8.0, 30.0, 8.0, 30.0], 1.0).unwrap();
        for (p, want) in corners
            .iter()
            .zip([(0.0, 0.0), (8.0, 0.0), (8.0, 30.0), (0.0, 30.0)])
        {
            let (x, y) = g.ground(*p).unwrap();
            assert!(
                close(x, want.0, 1e-6) && close(y, want.1, 1e-6),
                "{p:?}: {x} {y}"
            );
        }
        // The middle of the picture's centre line is not the middle of the
        // road: the far half is squeezed into fewer pixels.
        let (x, y) = g.ground(Point::new(300.0, 250.0)).unwrap();
        assert!(close(x, 4.0, 1e-6), "{x}");
        assert!(y > 20.0 && y < 30.0, "{y}: the far half is fewer pixels");
        // Lines along the road stay lines: the centre line is x = 4 m.
        for py in [120.0, 200.0, 380.0] {
            let (x, _) = g.ground(Point::new(300.0, py)).unwrap();
            assert!(close(x, 4.0, 1e-6), "{py}: {x}");
        }
    }

    #[test]
    fn calibration_refuses_what_is_no_rectangle() {
        let square = pts(&[[0.0, 0.0], [10.0, 0.0], [10.0, 10.0], [0.0, 10.0]]);
        assert_eq!(
            GroundPlane::new(&square[..3], [1.0; 4], 1.0),
            Err(CalibrationError::NotFour(3))
        );
        assert_eq!(
            GroundPlane::new(&square, [1.0, 0.0, 1.0, 1.0], 1.0),
            Err(CalibrationError::BadDistance(1, 0.0))
        );
        let dart = pts(&[[0.0, 0.0], [10.0, 0.0], [3.0, 3.0], [0.0, 10.0]]);
        assert_eq!(
            GroundPlane::new(&dart, [1.0; 4], 1.0),
            Err(CalibrationError::NotConvex)
        );
        // Either winding is a rectangle.
        let mut rev = square.clone();
        rev.reverse();
        assert!(GroundPlane::new(&rev, [1.0; 4], 1.0).is_ok());
    }

    #[test]
    fn distances_too_small_are_named_not_taken_for_a_bad_quadrilateral() {
        // A good rectangle whose sides are said to be 0.1 µm: the map's
        // arithmetic cannot hold it, and that is not the corners' fault.
        let square = pts(&[[0.0, 0.0], [10.0, 0.0], [10.0, 10.0], [0.0, 10.0]]);
        let e = GroundPlane::new(&square, [1e-7; 4], 1.0).unwrap_err();
        assert_eq!(e, CalibrationError::TooSmall(0, 1e-7));
        let text = e.to_string();
        assert!(text.contains("distance 0 is 0.0000001"), "{text}");
        assert!(text.contains("too small"), "{text}");
        assert!(!text.contains("convex"), "{text}");
        assert_eq!(
            GroundPlane::new(&square, [4.0, 12.0, 4.0, 0.0005], 1.0),
            Err(CalibrationError::TooSmall(3, 0.0005))
        );
        // The smallest side taken still calibrates, in feet too.
        for unit in [1.0, SpeedUnit::Mph.metres_per_distance()] {
            let g = GroundPlane::new(&square, [MIN_DISTANCE; 4], unit).unwrap();
            let (x, _) = g.ground(Point::new(10.0, 0.0)).unwrap();
            assert!(close(x, f64::from(MIN_DISTANCE) * unit, 1e-9), "{x}");
        }
    }

    #[test]
    fn feet_for_mph() {
        let g = GroundPlane::new(
            &pts(&[[0.0, 0.0], [100.0, 0.0], [100.0, 100.0], [0.0, 100.0]]),
            [100.0; 4],
            SpeedUnit::Mph.metres_per_distance(),
        )
        .unwrap();
        let (x, _) = g.ground(Point::new(100.0, 0.0)).unwrap();
        assert!(close(x, 30.48, 1e-9));
        // 30.48 m in one second is 68.18 mph, 109.73 km/h.
        assert!(close(SpeedUnit::Mph.from_mps(30.48), 68.1818, 1e-3));
        assert!(close(SpeedUnit::KmH.from_mps(30.48), 109.728, 1e-9));
    }

    fn t(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_800_000_000) + Duration::from_millis(ms)
    }

    #[test]
    fn the_window_fits_a_line_through_a_jittering_walk() {
        let mut w = SpeedWindow::default();
        assert_eq!(w.estimate(), None);
        // 2 m/s along x, 10 fps, +-5 cm of jitter.
        for f in 0..40u64 {
            let jitter = [0.05, -0.05, 0.03, -0.02, 0.0][(f % 5) as usize];
            w.push(t(f * 100), (0.2 * f as f64 + jitter, 3.0 - jitter));
            if f == 1 {
                assert_eq!(w.estimate(), None, "two frames are no estimate");
            }
            if f == 2 {
                let e = w.estimate().unwrap();
                assert!(!e.settled());
            }
        }
        let e = w.estimate().unwrap();
        assert!(e.settled());
        // The window holds the last second: 11 samples, 1 s.
        assert_eq!(e.span, Duration::from_secs(1));
        assert!(close(e.mps, 2.0, 0.1), "{e:?}");
        // A frame twice is ignored.
        w.push(t(3900), (100.0, 100.0));
        assert!(close(w.estimate().unwrap().mps, 2.0, 0.1));
        w.clear();
        assert_eq!(w.estimate(), None);
    }
}
