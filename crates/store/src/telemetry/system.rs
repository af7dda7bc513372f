//! Whole-machine figures for the status and the console: CPU time from
//! `/proc/stat` (a busy share needs two readings), memory from
//! `/proc/meminfo`, load from `/proc/loadavg`. What cannot be read is `None`.

/// Jiffies of all CPUs together since boot: busy and total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    pub busy: u64,
    pub total: u64,
}

impl CpuTimes {
    /// Busy share of the machine between `earlier` and `self`, 0..=100 %.
    pub fn percent_since(&self, earlier: &CpuTimes) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        let busy = self.busy.checked_sub(earlier.busy)?;
        (total > 0).then(|| (busy as f64 * 100.0 / total as f64).min(100.0))
    }
}

/// Reads `/proc/stat` now.
pub fn cpu_times() -> Option<CpuTimes> {
    parse_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// The aggregate `cpu` line: user nice system idle iowait irq softirq steal ...
/// (guest time is already inside user and nice).
pub fn parse_stat(text: &str) -> Option<CpuTimes> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 4 {
        return None;
    }
    let total: u64 = v.iter().sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some(CpuTimes {
        busy: total - idle,
        total,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    pub total_bytes: u64,
    pub available_bytes: u64,
}

/// Reads `/proc/meminfo` now.
pub fn memory() -> Option<Memory> {
    parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

pub fn parse_meminfo(text: &str) -> Option<Memory> {
    let field = |name: &str| -> Option<u64> {
        let l = text.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = l[name.len()..].split_whitespace().next()?.parse().ok()?;
        Some(kib * 1024)
    };
    Some(Memory {
        total_bytes: field("MemTotal:")?,
        available_bytes: field("MemAvailable:")?,
    })
}

/// The one-minute load average.
pub fn load1() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// CPUs this process may run on.
pub fn cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_share_from_two_readings() {
        let a = parse_stat("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n").unwrap();
        assert_eq!(
            a,
            CpuTimes {
                busy: 150,
                total: 1000
            }
        );
        let b = parse_stat("cpu  200 0 100 1100 100 0 0 0 0 0\n").unwrap();
        assert_eq!(b.percent_since(&a), Some(30.0));
        assert_eq!(a.percent_since(&a), None);
        assert_eq!(a.percent_since(&b), None);
        assert!(parse_stat("intr 1 2 3\n").is_none());
    }

    #[test]
    fn memory_from_meminfo() {
        let m = parse_meminfo(
            "MemTotal:        2048 kB\nMemFree:          100 kB\nMemAvailable:     512 kB\n",
        )
        .unwrap();
        assert_eq!(m.total_bytes, 2048 * 1024);
        assert_eq!(m.available_bytes, 512 * 1024);
        assert!(parse_meminfo("MemTotal: 1 kB\n").is_none());
    }
}
