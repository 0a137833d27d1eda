//! Human-readable numbers.

/// `1536` -> `1.5 KiB`.
pub fn bytes(value: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = value.max(0.0);
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats_bytes() {
        assert_eq!(super::bytes(512.0), "512 B");
        assert_eq!(super::bytes(1536.0), "1.5 KiB");
        assert_eq!(super::bytes(16.0 * 1024.0 * 1024.0), "16.0 MiB");
    }
}
