//! How much memory one attempt may use on this machine.

/// Memory one attempt may use: `--attempt-memory-mib` when given, else this machine's
/// memory (attempts run here one at a time per slot).
pub fn attempt_memory(mib: Option<u64>, slots: u32) -> Option<u64> {
    match mib {
        Some(mib) => Some(mib.saturating_mul(1 << 20)),
        None => machine_memory_bytes().map(|total| total / u64::from(slots.max(1))),
    }
}

/// This machine's memory in bytes (`MemTotal`), where `/proc/meminfo` says it.
pub fn machine_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}
