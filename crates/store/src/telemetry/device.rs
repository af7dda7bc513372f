//! Process and device sensors: /proc for the process; thermal zones and
//! Jetson's integrated GPU load from sysfs; discrete NVIDIA GPUs through
//! NVML, loaded at run time (libnvidia-ml.so.1), so the binary runs where
//! there is none. What the hardware does not report is `None`.

use std::path::Path;
use std::sync::OnceLock;

#[derive(Debug, Clone, Default)]
pub struct ProcessSample {
    pub resident_bytes: Option<u64>,
    pub cpu_seconds: Option<f64>,
    /// Bytes this process caused to be written to storage (`write_bytes`
    /// of /proc/self/io: pages it dirtied, counted again each time a page
    /// written back is dirtied anew): what the flash takes, the outbox's
    /// log above all. None where the kernel keeps no task I/O accounting.
    pub written_bytes: Option<u64>,
}

/// Resident memory and CPU time of this process.
pub fn process() -> ProcessSample {
    let resident_bytes = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map(|pages| pages * page_size());
    let cpu_seconds = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the command name (which may hold spaces, so split after the last ')').
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = f.get(11)?.parse().ok()?;
            let stime: f64 = f.get(12)?.parse().ok()?;
            Some((utime + stime) / clock_ticks())
        });
    let written_bytes = std::fs::read_to_string("/proc/self/io").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("write_bytes:"))
            .and_then(|v| v.trim().parse().ok())
    });
    ProcessSample {
        resident_bytes,
        cpu_seconds,
        written_bytes,
    }
}

fn page_size() -> u64 {
    // Linux on x86_64 and aarch64 (Jetson kernels use 4 KiB pages); read the
    // kernel's figure when the auxiliary vector is exposed.
    std::fs::read("/proc/self/auxv")
        .ok()
        .and_then(|b| {
            b.chunks_exact(16).find_map(|c| {
                let key = u64::from_ne_bytes(c[..8].try_into().ok()?);
                if key == 6 {
                    Some(u64::from_ne_bytes(c[8..].try_into().ok()?))
                } else {
                    None
                }
            })
        })
        .filter(|p| *p > 0)
        .unwrap_or(4096)
}

fn clock_ticks() -> f64 {
    // USER_HZ is 100 on every Linux architecture outpost targets.
    100.0
}

#[derive(Debug, Clone, Default)]
pub struct Gpu {
    pub index: u32,
    pub name: String,
    pub utilization: Option<f64>,
    pub memory_used_bytes: Option<u64>,
    pub memory_free_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub temperature_celsius: Option<f64>,
}

#[derive(Debug, Clone, Default)]
pub struct DeviceSample {
    /// (zone type, °C)
    pub temperatures: Vec<(String, f64)>,
    pub gpus: Vec<Gpu>,
}

/// Reads the device's sensors now.
pub fn sample() -> DeviceSample {
    let mut d = DeviceSample {
        temperatures: thermal_zones(Path::new("/sys/class/thermal")),
        gpus: Vec::new(),
    };
    if let Some(g) = jetson_gpu(Path::new("/sys/devices")) {
        d.gpus.push(g);
    }
    d.gpus.extend(nvml::sample());
    d
}

/// `/sys/class/thermal/thermal_zone*/{type,temp}` (millidegrees).
pub fn thermal_zones(root: &Path) -> Vec<(String, f64)> {
    let mut v = Vec::new();
    let Ok(rd) = std::fs::read_dir(root) else {
        return v;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("thermal_zone") {
            continue;
        }
        let p = e.path();
        let (Ok(kind), Ok(temp)) = (
            std::fs::read_to_string(p.join("type")),
            std::fs::read_to_string(p.join("temp")),
        ) else {
            continue;
        };
        if let Ok(milli) = temp.trim().parse::<f64>() {
            v.push((format!("{}:{}", name, kind.trim()), milli / 1000.0));
        }
    }
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Jetson's integrated GPU: `gpu.0/load` is in tenths of a percent.
pub fn jetson_gpu(sys_devices: &Path) -> Option<Gpu> {
    for p in [
        sys_devices.join("gpu.0/load"),
        sys_devices.join("platform/gpu.0/load"),
        sys_devices.join("platform/17000000.gpu/load"),
    ] {
        if let Ok(s) = std::fs::read_to_string(&p)
            && let Ok(load) = s.trim().parse::<f64>()
        {
            return Some(Gpu {
                index: 0,
                name: "jetson-igpu".into(),
                utilization: Some(load / 1000.0),
                ..Default::default()
            });
        }
    }
    None
}

mod nvml {
    //! The few NVML calls needed, resolved from libnvidia-ml.so.1 at run time.
    use super::{Gpu, OnceLock};
    use std::ffi::{c_char, c_int, c_uint, c_void};

    type Device = *mut c_void;
    #[repr(C)]
    struct Utilization {
        gpu: c_uint,
        memory: c_uint,
    }
    #[repr(C)]
    struct Memory {
        total: u64,
        free: u64,
        used: u64,
    }

    struct Nvml {
        _lib: libloading::Library,
        count: unsafe extern "C" fn(*mut c_uint) -> c_int,
        handle: unsafe extern "C" fn(c_uint, *mut Device) -> c_int,
        name: unsafe extern "C" fn(Device, *mut c_char, c_uint) -> c_int,
        util: unsafe extern "C" fn(Device, *mut Utilization) -> c_int,
        mem: unsafe extern "C" fn(Device, *mut Memory) -> c_int,
        temp: unsafe extern "C" fn(Device, c_int, *mut c_uint) -> c_int,
    }

    // SAFETY: NVML is thread-safe after nvmlInit; the function pointers are plain C functions.
    unsafe impl Send for Nvml {}
    // SAFETY: as above: NVML's calls may come from any thread at once.
    unsafe impl Sync for Nvml {}

    fn load() -> Option<Nvml> {
        // SAFETY: loading NVML runs its initialisers only; every symbol is
        // looked up with the signature NVML's header declares.
        unsafe {
            let lib = libloading::Library::new("libnvidia-ml.so.1").ok()?;
            let init: libloading::Symbol<unsafe extern "C" fn() -> c_int> =
                lib.get(b"nvmlInit_v2").ok()?;
            if init() != 0 {
                return None;
            }
            let count = *lib.get(b"nvmlDeviceGetCount_v2").ok()?;
            let handle = *lib.get(b"nvmlDeviceGetHandleByIndex_v2").ok()?;
            let name = *lib.get(b"nvmlDeviceGetName").ok()?;
            let util = *lib.get(b"nvmlDeviceGetUtilizationRates").ok()?;
            let mem = *lib.get(b"nvmlDeviceGetMemoryInfo").ok()?;
            let temp = *lib.get(b"nvmlDeviceGetTemperature").ok()?;
            Some(Nvml {
                _lib: lib,
                count,
                handle,
                name,
                util,
                mem,
                temp,
            })
        }
    }

    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();

    pub fn sample() -> Vec<Gpu> {
        let Some(n) = NVML.get_or_init(load) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        // SAFETY: pointers passed are to live locals of the types NVML expects.
        unsafe {
            let mut count: c_uint = 0;
            if (n.count)(&mut count) != 0 {
                return out;
            }
            for i in 0..count {
                let mut dev: Device = std::ptr::null_mut();
                if (n.handle)(i, &mut dev) != 0 {
                    continue;
                }
                let mut buf = [0 as c_char; 96];
                let name = if (n.name)(dev, buf.as_mut_ptr(), buf.len() as c_uint) == 0 {
                    std::ffi::CStr::from_ptr(buf.as_ptr())
                        .to_string_lossy()
                        .into_owned()
                } else {
                    format!("gpu{i}")
                };
                let mut u = Utilization { gpu: 0, memory: 0 };
                let util = ((n.util)(dev, &mut u) == 0).then(|| u.gpu as f64 / 100.0);
                let mut m = Memory {
                    total: 0,
                    free: 0,
                    used: 0,
                };
                let mem_ok = (n.mem)(dev, &mut m) == 0;
                let mut t: c_uint = 0;
                // 0 = NVML_TEMPERATURE_GPU
                let temp = ((n.temp)(dev, 0, &mut t) == 0).then_some(t as f64);
                out.push(Gpu {
                    index: i,
                    name,
                    utilization: util,
                    memory_used_bytes: mem_ok.then_some(m.used),
                    memory_free_bytes: mem_ok.then_some(m.free),
                    memory_total_bytes: mem_ok.then_some(m.total),
                    temperature_celsius: temp,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_figures_are_read() {
        let p = process();
        assert!(p.resident_bytes.unwrap() > 1_000_000);
        assert!(p.cpu_seconds.is_some());
    }

    #[test]
    fn sysfs_sensors_from_a_fake_tree() {
        let d = tempfile::tempdir().unwrap();
        let z = d.path().join("thermal/thermal_zone0");
        std::fs::create_dir_all(&z).unwrap();
        std::fs::write(z.join("type"), "GPU-therm\n").unwrap();
        std::fs::write(z.join("temp"), "41500\n").unwrap();
        assert_eq!(
            thermal_zones(&d.path().join("thermal")),
            vec![("thermal_zone0:GPU-therm".to_string(), 41.5)]
        );
        assert!(jetson_gpu(d.path()).is_none(), "absent is absent");
        std::fs::create_dir_all(d.path().join("gpu.0")).unwrap();
        std::fs::write(d.path().join("gpu.0/load"), "625\n").unwrap();
        assert_eq!(jetson_gpu(d.path()).unwrap().utilization, Some(0.625));
    }
}
