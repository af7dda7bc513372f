//! The built-in camera pipelines as plans: element factories with typed
//! properties, in link order. `run.rs` makes each element with
//! `ElementFactory::make`, sets its properties and links them in code;
//! nothing from a config is ever parsed as pipeline syntax, so a device
//! path can only ever be a device path. (A hand-written `pipeline = "..."`
//! is the one launch description outpost parses.)

use super::{CameraDef, CameraUrl};

/// One element: its factory, an optional name, and its properties.
#[derive(Debug, Clone, PartialEq)]
pub struct ElementPlan {
    pub factory: &'static str,
    pub name: Option<&'static str>,
    pub props: Vec<(&'static str, Prop)>,
}

/// A property value, typed: set on the element as that type or refused.
#[derive(Debug, Clone, PartialEq)]
pub enum Prop {
    Text(String),
    Int(i64),
    Caps(Vec<CapsPlan>),
}

/// One structure of a caps value (`video/x-raw(memory:NVMM),width=..`).
#[derive(Debug, Clone, PartialEq)]
pub struct CapsPlan {
    pub media: &'static str,
    /// A caps feature such as `memory:NVMM`.
    pub feature: Option<&'static str>,
    pub formats: Vec<&'static str>,
    pub size: Option<(u32, u32)>,
    pub fps: Option<u32>,
}

impl CapsPlan {
    fn media(media: &'static str) -> CapsPlan {
        CapsPlan {
            media,
            feature: None,
            formats: Vec::new(),
            size: None,
            fps: None,
        }
    }
}

impl ElementPlan {
    fn new(factory: &'static str) -> ElementPlan {
        ElementPlan {
            factory,
            name: None,
            props: Vec::new(),
        }
    }

    fn named(mut self, name: &'static str) -> ElementPlan {
        self.name = Some(name);
        self
    }

    fn prop(mut self, key: &'static str, v: Prop) -> ElementPlan {
        self.props.push((key, v));
        self
    }
}

/// The tail every built-in pipeline ends with: colour conversion (and
/// scaling) to I420 or packed RGB at the appsink `outpost`.
pub fn rgb_tail(size: Option<(u32, u32)>) -> Vec<ElementPlan> {
    let mut caps = CapsPlan::media("video/x-raw");
    caps.formats = vec!["I420", "RGB"];
    caps.size = size;
    vec![
        ElementPlan::new("videoconvert").named("outpost_convert"),
        ElementPlan::new("videoscale"),
        ElementPlan::new("capsfilter").prop("caps", Prop::Caps(vec![caps])),
        ElementPlan::new("appsink").named("outpost"),
    ]
}

/// The whole pipeline of the cameras that need no RTSP negotiation (V4L2,
/// CSI); `None` for RTSP, whose decoder is chosen when the server answers.
/// `fps`: the most any reader of the camera wants (`None`: every frame).
pub fn source_plan(c: &CameraDef, fps: Option<f64>, url: &CameraUrl) -> Option<Vec<ElementPlan>> {
    let size = c.width.zip(c.height);
    let mut plan = match url {
        CameraUrl::Rtsp { .. } => return None,
        CameraUrl::V4l2 { device } => {
            let mut v =
                vec![ElementPlan::new("v4l2src").prop("device", Prop::Text(device.clone()))];
            if let Some(s) = size {
                // Raw or MJPEG at that size, whichever the camera offers.
                let mut raw = CapsPlan::media("video/x-raw");
                raw.size = Some(s);
                let mut jpeg = CapsPlan::media("image/jpeg");
                jpeg.size = Some(s);
                v.push(ElementPlan::new("capsfilter").prop("caps", Prop::Caps(vec![raw, jpeg])));
            }
            v.push(ElementPlan::new("decodebin"));
            v
        }
        CameraUrl::Csi { sensor } => {
            let (w, h) = size.unwrap_or((1920, 1080));
            let fps = fps.map(|f| f.ceil() as u32).unwrap_or(30).max(1);
            let mut nvmm = CapsPlan::media("video/x-raw");
            nvmm.feature = Some("memory:NVMM");
            nvmm.size = Some((w, h));
            nvmm.fps = Some(fps);
            let mut bgrx = CapsPlan::media("video/x-raw");
            bgrx.formats = vec!["BGRx"];
            vec![
                ElementPlan::new("nvarguscamerasrc")
                    .prop("sensor-id", Prop::Int(i64::from(*sensor))),
                ElementPlan::new("capsfilter").prop("caps", Prop::Caps(vec![nvmm])),
                ElementPlan::new("nvvidconv"),
                ElementPlan::new("capsfilter").prop("caps", Prop::Caps(vec![bgrx])),
            ]
        }
    };
    plan.extend(rgb_tail(None));
    Some(plan)
}

/// The factories of a plan, `a ! b ! c`, for logs.
pub fn chain(plan: &[ElementPlan]) -> String {
    plan.iter()
        .map(|e| e.factory)
        .collect::<Vec<_>>()
        .join(" ! ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(w: Option<u32>, h: Option<u32>) -> CameraDef {
        CameraDef {
            name: "c".into(),
            url: None,
            pipeline: None,
            width: w,
            height: h,
            transport: Default::default(),
            stall_timeout: std::time::Duration::from_secs(5),
            decode: Default::default(),
            max_frame_bytes: 8 << 20,
            fps: None,
        }
    }

    #[test]
    fn plans_name_the_elements_and_carry_values_as_properties() {
        let c = cfg(Some(1280), Some(720));
        let p = source_plan(&c, None, &CameraUrl::parse("v4l2:///dev/video0").unwrap()).unwrap();
        assert_eq!(
            chain(&p),
            "v4l2src ! capsfilter ! decodebin ! videoconvert ! videoscale ! capsfilter ! appsink"
        );
        assert_eq!(p[0].props, [("device", Prop::Text("/dev/video0".into()))]);
        let Prop::Caps(caps) = &p[1].props[0].1 else {
            panic!("{p:?}")
        };
        assert_eq!(caps.len(), 2);
        assert!(caps.iter().all(|s| s.size == Some((1280, 720))));
        assert_eq!(p.last().unwrap().name, Some("outpost"));
        let c = cfg(None, None);
        let p = source_plan(&c, Some(15.0), &CameraUrl::Csi { sensor: 1 }).unwrap();
        assert_eq!(p[0].props, [("sensor-id", Prop::Int(1))]);
        let Prop::Caps(caps) = &p[1].props[0].1 else {
            panic!("{p:?}")
        };
        assert_eq!(
            (caps[0].feature, caps[0].fps, caps[0].size),
            (Some("memory:NVMM"), Some(15), Some((1920, 1080)))
        );
        assert!(chain(&p).contains("nvvidconv"));
        assert!(source_plan(&c, None, &CameraUrl::parse("rtsp://h/x").unwrap()).is_none());
        let tail = rgb_tail(Some((640, 480)));
        assert_eq!(tail[0].name, Some("outpost_convert"));
        let Prop::Caps(caps) = &tail[2].props[0].1 else {
            panic!("{tail:?}")
        };
        assert_eq!(caps[0].formats, ["I420", "RGB"]);
        assert_eq!(caps[0].size, Some((640, 480)));
    }

    /// Whatever a device string holds, it stays one property of one element.
    #[test]
    fn a_device_string_with_pipeline_syntax_stays_one_property() {
        let evil = "/dev/null ! fakesink videotestsrc ! filesink location=/tmp/VICTIM".to_string();
        let c = cfg(None, None);
        let p = source_plan(
            &c,
            None,
            &CameraUrl::V4l2 {
                device: evil.clone(),
            },
        )
        .unwrap();
        assert_eq!(
            chain(&p),
            "v4l2src ! decodebin ! videoconvert ! videoscale ! capsfilter ! appsink"
        );
        assert_eq!(p[0].props, [("device", Prop::Text(evil))]);
    }
}
