//! Kubernetes resource quantities (`32Gi`, `500M`, `8`, `500m`), read the way the
//! Kubernetes API reads them, so a pools file says memory and CPU exactly as a Pod
//! manifest would and the number tuneq computes with is the one the cluster enforces.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A quantity as written (kept for manifests) and its value in base units: bytes for
/// memory, thousandths of a CPU for CPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quantity {
    text: String,
    value: u64,
}

/// Why a quantity was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{text}` is not a quantity: {why} (write e.g. `32Gi`, `512Mi`, `8`, `500m`)")]
pub struct QuantityError {
    text: String,
    why: &'static str,
}

impl Quantity {
    /// Memory: a number with an optional binary (`Ki` `Mi` `Gi` `Ti`) or decimal (`k` `M`
    /// `G` `T`) suffix, in bytes. Fractions are allowed (`1.5Gi`).
    pub fn memory(text: &str) -> Result<Self, QuantityError> {
        Self::parse(text, 1)
    }

    /// CPU: cores (`8`, `0.5`) or thousandths (`500m`), in thousandths of a core.
    pub fn cpu(text: &str) -> Result<Self, QuantityError> {
        Self::parse(text, 1000)
    }

    /// `bytes` of memory, written as a plain number.
    pub fn bytes(bytes: u64) -> Self {
        Self {
            text: bytes.to_string(),
            value: bytes,
        }
    }

    /// `millis` thousandths of a core, written as `<millis>m`.
    pub fn millicores(millis: u64) -> Self {
        Self {
            text: format!("{millis}m"),
            value: millis,
        }
    }

    /// Its value in base units (bytes, or thousandths of a core).
    pub fn value(&self) -> u64 {
        self.value
    }

    /// As written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    fn parse(text: &str, unit: u64) -> Result<Self, QuantityError> {
        let err = |why| QuantityError {
            text: text.to_string(),
            why,
        };
        let trimmed = text.trim();
        let split = trimmed
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(trimmed.len());
        let (number, suffix) = trimmed.split_at(split);
        if number.is_empty() || number.matches('.').count() > 1 {
            return Err(err("it does not start with a number"));
        }
        let multiplier: f64 = match suffix {
            "" => unit as f64,
            "m" if unit == 1000 => 1.0,
            "k" => 1e3 * unit as f64,
            "M" => 1e6 * unit as f64,
            "G" => 1e9 * unit as f64,
            "T" => 1e12 * unit as f64,
            "Ki" => (1u64 << 10) as f64 * unit as f64,
            "Mi" => (1u64 << 20) as f64 * unit as f64,
            "Gi" => (1u64 << 30) as f64 * unit as f64,
            "Ti" => (1u64 << 40) as f64 * unit as f64,
            _ => return Err(err("unknown suffix")),
        };
        let number: f64 = number.parse().map_err(|_| err("not a number"))?;
        let value = (number * multiplier).ceil();
        if !value.is_finite() || value <= 0.0 || value > 1e18 {
            return Err(err("it must be above zero and below an exabyte"));
        }
        Ok(Self {
            text: trimmed.to_string(),
            value: value as u64,
        })
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

/// A memory quantity in a pools file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Memory(pub Quantity);

/// A CPU quantity in a pools file (also accepted as a bare TOML number).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Cpu(pub Quantity);

impl Memory {
    /// Bytes.
    pub fn bytes(&self) -> u64 {
        self.0.value()
    }
}

impl Cpu {
    /// Thousandths of a core.
    pub fn millis(&self) -> u64 {
        self.0.value()
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TextOrNumber {
    Text(String),
    Integer(u64),
    Float(f64),
}

impl TextOrNumber {
    fn into_text(self) -> String {
        match self {
            Self::Text(t) => t,
            Self::Integer(n) => n.to_string(),
            Self::Float(n) => n.to_string(),
        }
    }
}

impl<'de> Deserialize<'de> for Memory {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = TextOrNumber::deserialize(d)?.into_text();
        Quantity::memory(&text)
            .map(Memory)
            .map_err(serde::de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for Cpu {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = TextOrNumber::deserialize(d)?.into_text();
        Quantity::cpu(&text)
            .map(Cpu)
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn quantities_read_as_kubernetes_reads_them() {
        let cases = [
            ("32Gi", 32u64 << 30),
            ("512Mi", 512 << 20),
            ("1.5Gi", 3 << 29),
            ("2G", 2_000_000_000),
            ("4096", 4096),
            ("1Ki", 1024),
        ];
        for (text, bytes) in cases {
            assert_eq!(Quantity::memory(text).unwrap().value(), bytes, "{text}");
        }
        for (text, millis) in [("8", 8000u64), ("500m", 500), ("0.5", 500), ("2.25", 2250)] {
            assert_eq!(Quantity::cpu(text).unwrap().value(), millis, "{text}");
        }
        for bad in ["", "Gi", "32GB", "-1Gi", "0", "1.2.3", "500m"] {
            assert!(Quantity::memory(bad).is_err(), "{bad}");
        }
        assert!(Quantity::cpu("8 cores").is_err());
    }
}
