//! Plane geometry of zones and lines in source-frame pixels (y grows
//! downwards): polygon checks, point in polygon, the side of a line.
//!
//! A few lines each; a geometry crate (`geo`) would bring an R-tree and a
//! geodesy library into the build for the same three predicates.

/// A point in source-frame pixels.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Point {
    pub x: f32,
    pub y: f32,
}

impl Point {
    pub const fn new(x: f32, y: f32) -> Self {
        Point { x, y }
    }

    pub fn is_finite(self) -> bool {
        self.x.is_finite() && self.y.is_finite()
    }

    pub fn distance(self, o: Point) -> f32 {
        ((self.x - o.x).powi(2) + (self.y - o.y).powi(2)).sqrt()
    }

    /// The bottom centre of an `[x1, y1, x2, y2]` box: where an object
    /// stands on the ground.
    pub fn bottom_centre(b: &[f32; 4]) -> Point {
        Point::new((b[0] + b[2]) / 2.0, b[1].max(b[3]))
    }
}

/// z of (b - a) x (c - a): > 0 when c is on one side of a->b, < 0 on the
/// other, 0 on the line.
fn cross(a: Point, b: Point, c: Point) -> f32 {
    (b.x - a.x) * (c.y - a.y) - (b.y - a.y) * (c.x - a.x)
}

/// Why a polygon cannot be a zone.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolygonError {
    #[error("{0} points; a polygon needs at least 3")]
    TooFew(usize),
    #[error("point {0} is not a finite number")]
    NotFinite(usize),
    #[error("points {0} and {1} are the same")]
    Repeated(usize, usize),
    #[error("the points are on one line: the polygon has no area")]
    NoArea,
    #[error("edges {0} and {1} cross each other")]
    Crossing(usize, usize),
}

/// Accepts a simple polygon (edges meet only at shared vertices) with an
/// area; either winding order.
pub fn check_polygon(pts: &[Point]) -> Result<(), PolygonError> {
    let n = pts.len();
    if n < 3 {
        return Err(PolygonError::TooFew(n));
    }
    if let Some(i) = pts.iter().position(|p| !p.is_finite()) {
        return Err(PolygonError::NotFinite(i));
    }
    for i in 0..n {
        let j = (i + 1) % n;
        if pts[i] == pts[j] {
            return Err(PolygonError::Repeated(i, j));
        }
    }
    for i in 0..n {
        for j in i + 1..n {
            // Neighbouring edges share a vertex; that is no crossing.
            if j == i + 1 || (i == 0 && j == n - 1) {
                continue;
            }
            let (a, b) = (pts[i], pts[(i + 1) % n]);
            let (c, d) = (pts[j], pts[(j + 1) % n]);
            if segments_intersect(a, b, c, d) {
                return Err(PolygonError::Crossing(i, j));
            }
        }
    }
    if area(pts).abs() < 0.5 {
        return Err(PolygonError::NoArea);
    }
    Ok(())
}

/// Signed area (shoelace).
pub fn area(pts: &[Point]) -> f32 {
    let n = pts.len();
    let mut s = 0.0f64;
    for i in 0..n {
        let (a, b) = (pts[i], pts[(i + 1) % n]);
        s += a.x as f64 * b.y as f64 - b.x as f64 * a.y as f64;
    }
    (s / 2.0) as f32
}

fn on_segment(a: Point, b: Point, c: Point) -> bool {
    c.x >= a.x.min(b.x) && c.x <= a.x.max(b.x) && c.y >= a.y.min(b.y) && c.y <= a.y.max(b.y)
}

/// Whether segments a-b and c-d touch (including at an end or collinear overlap).
pub fn segments_intersect(a: Point, b: Point, c: Point, d: Point) -> bool {
    let d1 = cross(c, d, a);
    let d2 = cross(c, d, b);
    let d3 = cross(a, b, c);
    let d4 = cross(a, b, d);
    if ((d1 > 0.0 && d2 < 0.0) || (d1 < 0.0 && d2 > 0.0))
        && ((d3 > 0.0 && d4 < 0.0) || (d3 < 0.0 && d4 > 0.0))
    {
        return true;
    }
    (d1 == 0.0 && on_segment(c, d, a))
        || (d2 == 0.0 && on_segment(c, d, b))
        || (d3 == 0.0 && on_segment(a, b, c))
        || (d4 == 0.0 && on_segment(a, b, d))
}

/// A zone's polygon with its bounding box, for a cheap reject first.
#[derive(Debug, Clone)]
pub struct Polygon {
    pts: Vec<Point>,
    min: Point,
    max: Point,
}

impl Polygon {
    /// The polygon of checked points (see [`check_polygon`]).
    pub fn new(pts: Vec<Point>) -> Self {
        let mut min = Point::new(f32::INFINITY, f32::INFINITY);
        let mut max = Point::new(f32::NEG_INFINITY, f32::NEG_INFINITY);
        for p in &pts {
            min = Point::new(min.x.min(p.x), min.y.min(p.y));
            max = Point::new(max.x.max(p.x), max.y.max(p.y));
        }
        Polygon { pts, min, max }
    }

    /// Even-odd ray casting; a point on the boundary may fall either way,
    /// which zone inertia absorbs.
    pub fn contains(&self, p: Point) -> bool {
        if p.x < self.min.x || p.x > self.max.x || p.y < self.min.y || p.y > self.max.y {
            return false;
        }
        let n = self.pts.len();
        let mut inside = false;
        let mut j = n - 1;
        for i in 0..n {
            let (a, b) = (self.pts[i], self.pts[j]);
            if (a.y > p.y) != (b.y > p.y) && p.x < (b.x - a.x) * (p.y - a.y) / (b.y - a.y) + a.x {
                inside = !inside;
            }
            j = i;
        }
        inside
    }
}

/// Which side of a line a point is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Left with the image turned so that the line's first point is at the
    /// top and its second at the bottom (x < 320 for `[[320, 0], [320, 480]]`).
    Left,
    Right,
}

/// A counting line: the segment between two points.
#[derive(Debug, Clone, Copy)]
pub struct Segment {
    a: Point,
    b: Point,
    len: f32,
}

impl Segment {
    pub fn new(a: Point, b: Point) -> Self {
        Segment {
            a,
            b,
            len: a.distance(b),
        }
    }

    /// Where `p` is: on a side, within `margin` pixels of the line, or
    /// beyond the segment's ends by more than `margin` along it (passing
    /// around the end of a line is no crossing).
    pub fn place(&self, p: Point, margin: f32) -> Place {
        let len = self.len.max(f32::MIN_POSITIVE);
        // Signed distance to the line and position along it.
        let dist = cross(self.a, self.b, p) / len;
        let along = ((p.x - self.a.x) * (self.b.x - self.a.x)
            + (p.y - self.a.y) * (self.b.y - self.a.y))
            / len;
        if along < -margin || along > len + margin {
            return Place::Beyond;
        }
        if dist.abs() <= margin {
            return Place::OnLine;
        }
        // Image y grows downwards: a positive cross product is the left
        // with the image turned so that a is at the top and b below it.
        Place::Side(if dist > 0.0 { Side::Left } else { Side::Right })
    }

    /// The side of `p`, if it is on one (see [`Segment::place`]).
    pub fn side(&self, p: Point, margin: f32) -> Option<Side> {
        match self.place(p, margin) {
            Place::Side(s) => Some(s),
            _ => None,
        }
    }
}

/// Where a point is relative to a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Side(Side),
    OnLine,
    Beyond,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pts(v: &[[f32; 2]]) -> Vec<Point> {
        v.iter().map(|p| Point::new(p[0], p[1])).collect()
    }

    #[test]
    fn polygons_checked() {
        let square = pts(&[[0.0, 0.0], [10.0, 0.0], [10.0, 10.0], [0.0, 10.0]]);
        assert_eq!(check_polygon(&square), Ok(()));
        let mut rev = square.clone();
        rev.reverse();
        assert_eq!(check_polygon(&rev), Ok(()));
        let concave = pts(&[
            [0.0, 0.0],
            [10.0, 0.0],
            [5.0, 5.0],
            [10.0, 10.0],
            [0.0, 10.0],
        ]);
        assert_eq!(check_polygon(&concave), Ok(()));
        let bow = pts(&[[0.0, 0.0], [10.0, 10.0], [10.0, 0.0], [0.0, 10.0]]);
        assert_eq!(check_polygon(&bow), Err(PolygonError::Crossing(0, 2)));
        assert_eq!(
            check_polygon(&pts(&[[0.0, 0.0], [1.0, 1.0]])),
            Err(PolygonError::TooFew(2))
        );
        assert_eq!(
            check_polygon(&pts(&[[0.0, 0.0], [5.0, 5.0], [9.0, 9.0]])),
            Err(PolygonError::NoArea)
        );
        assert_eq!(
            check_polygon(&pts(&[[0.0, 0.0], [5.0, 0.0], [5.0, 0.0], [0.0, 5.0]])),
            Err(PolygonError::Repeated(1, 2))
        );
        assert_eq!(
            check_polygon(&pts(&[[0.0, 0.0], [f32::NAN, 0.0], [0.0, 5.0]])),
            Err(PolygonError::NotFinite(1))
        );
        // A vertex touching a non-neighbouring edge is not simple either.
        let touch = pts(&[
            [0.0, 0.0],
            [10.0, 0.0],
            [10.0, 10.0],
            [5.0, 0.0],
            [0.0, 10.0],
        ]);
        assert!(matches!(
            check_polygon(&touch),
            Err(PolygonError::Crossing(..))
        ));
    }

    #[test]
    fn point_in_polygon() {
        let concave = Polygon::new(pts(&[
            [0.0, 0.0],
            [10.0, 0.0],
            [5.0, 5.0],
            [10.0, 10.0],
            [0.0, 10.0],
        ]));
        assert!(concave.contains(Point::new(2.0, 5.0)));
        assert!(!concave.contains(Point::new(9.0, 5.0)), "in the notch");
        assert!(!concave.contains(Point::new(-1.0, 5.0)));
        assert!(!concave.contains(Point::new(5.0, 11.0)));
    }

    #[test]
    fn sides_of_a_line() {
        // The gate: from the left (x < 320) to the right is "in".
        let s = Segment::new(Point::new(320.0, 0.0), Point::new(320.0, 480.0));
        assert_eq!(s.side(Point::new(100.0, 240.0), 2.0), Some(Side::Left));
        assert_eq!(s.side(Point::new(500.0, 240.0), 2.0), Some(Side::Right));
        assert_eq!(s.side(Point::new(321.0, 240.0), 2.0), None, "in the margin");
        assert_eq!(s.side(Point::new(100.0, 600.0), 2.0), None, "past the end");
        assert_eq!(s.place(Point::new(100.0, 600.0), 2.0), Place::Beyond);
        assert_eq!(s.place(Point::new(319.0, 481.0), 2.0), Place::OnLine);
        // A horizontal line drawn left to right: turned so that its first
        // point is at the top, what was below it is on the left.
        let h = Segment::new(Point::new(0.0, 100.0), Point::new(200.0, 100.0));
        assert_eq!(h.side(Point::new(50.0, 150.0), 0.0), Some(Side::Left));
        assert_eq!(h.side(Point::new(50.0, 50.0), 0.0), Some(Side::Right));
    }

    #[test]
    fn bottom_centre_of_a_box() {
        assert_eq!(
            Point::bottom_centre(&[10.0, 20.0, 30.0, 60.0]),
            Point::new(20.0, 60.0)
        );
    }
}
