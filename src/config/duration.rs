//! Go's `time.Duration` text (`"30s"`, `"1m0s"`, `"1.5ms"`), as the config file writes
//! durations: parsing with `time.ParseDuration`'s grammar and errors, formatting as
//! `Duration.String`.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

const NANOS_PER_SECOND: i64 = 1_000_000_000;

/// Why a duration string was rejected; the text matches Go's `time.ParseDuration` errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("time: invalid duration {0:?}")]
    Invalid(String),
    #[error("time: missing unit in duration {0:?}")]
    MissingUnit(String),
    #[error("time: unknown unit {unit:?} in duration {input:?}")]
    UnknownUnit { unit: String, input: String },
}

/// A signed span of nanoseconds written the way Go's `time.Duration` is (`"30s"`, `"1m0s"`,
/// `"1.5ms"`, `"-2h45m0s"`). Negative values are representable because the config format
/// allows writing them (validation then rejects most).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GoDuration(pub i64);

impl GoDuration {
    pub const ZERO: GoDuration = GoDuration(0);

    pub fn from_secs(secs: i64) -> GoDuration {
        GoDuration(secs.saturating_mul(NANOS_PER_SECOND))
    }

    pub(crate) fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// The duration as a `std` one; `None` when negative.
    pub(crate) fn to_std(self) -> Option<Duration> {
        u64::try_from(self.0).ok().map(Duration::from_nanos)
    }

    /// Parses Go's duration syntax: `[-+]?([0-9]*(\.[0-9]*)?[a-z]+)+`, or a bare `0`, with
    /// units `ns`, `us`/`µs`/`μs`, `ms`, `s`, `m`, `h`. Fractions are accepted per unit.
    pub fn parse(input: &str) -> Result<GoDuration, DurationError> {
        let invalid = || DurationError::Invalid(input.to_string());
        let mut rest = input.as_bytes();
        let mut negative = false;
        if let Some(&sign) = rest.first()
            && (sign == b'-' || sign == b'+')
        {
            negative = sign == b'-';
            rest = &rest[1..];
        }
        if rest == b"0" {
            return Ok(GoDuration::ZERO);
        }
        if rest.is_empty() {
            return Err(invalid());
        }
        const LIMIT: u64 = 1 << 63;
        let mut total: u64 = 0;
        while !rest.is_empty() {
            if !(rest[0] == b'.' || rest[0].is_ascii_digit()) {
                return Err(invalid());
            }
            let (whole, after_int) = leading_int(rest).ok_or_else(invalid)?;
            let had_int = after_int.len() != rest.len();
            rest = after_int;
            let mut fraction = 0u64;
            let mut scale = 1f64;
            let mut had_fraction = false;
            if rest.first() == Some(&b'.') {
                let (f, s, after_frac) = leading_fraction(&rest[1..]);
                had_fraction = after_frac.len() != rest.len() - 1;
                fraction = f;
                scale = s;
                rest = after_frac;
            }
            if !had_int && !had_fraction {
                return Err(invalid());
            }
            let unit_len = rest.iter().position(|&c| c == b'.' || c.is_ascii_digit()).unwrap_or(rest.len());
            if unit_len == 0 {
                return Err(DurationError::MissingUnit(input.to_string()));
            }
            let unit_text = &rest[..unit_len];
            rest = &rest[unit_len..];
            let unit: u64 = match unit_text {
                b"ns" => 1,
                b"us" => 1_000,
                // U+00B5 (micro sign) and U+03BC (Greek small letter mu).
                [0xC2, 0xB5, b's'] | [0xCE, 0xBC, b's'] => 1_000,
                b"ms" => 1_000_000,
                b"s" => 1_000_000_000,
                b"m" => 60_000_000_000,
                b"h" => 3_600_000_000_000,
                _ => {
                    return Err(DurationError::UnknownUnit {
                        unit: String::from_utf8_lossy(unit_text).into_owned(),
                        input: input.to_string(),
                    });
                }
            };
            if whole > LIMIT / unit {
                return Err(invalid());
            }
            let mut value = whole * unit;
            if fraction > 0 {
                // Go computes the fractional part in float64 too (exact to the nanosecond for
                // every unit up to hours).
                value += (fraction as f64 * (unit as f64 / scale)) as u64;
                if value > LIMIT {
                    return Err(invalid());
                }
            }
            total = total.checked_add(value).filter(|t| *t <= LIMIT).ok_or_else(invalid)?;
        }
        if negative {
            // total <= 2^63, so the negation fits (i64::MIN at most).
            return Ok(GoDuration((-(i128::from(total))) as i64));
        }
        i64::try_from(total).map(GoDuration).map_err(|_| invalid())
    }
}

/// Consumes `[0-9]*`; `None` on overflow past 2^63 (Go's `errLeadingInt`).
fn leading_int(s: &[u8]) -> Option<(u64, &[u8])> {
    let mut value: u64 = 0;
    let mut i = 0;
    while i < s.len() && s[i].is_ascii_digit() {
        if value > (1u64 << 63) / 10 {
            return None;
        }
        value = value * 10 + u64::from(s[i] - b'0');
        if value > 1u64 << 63 {
            return None;
        }
        i += 1;
    }
    Some((value, &s[i..]))
}

/// Consumes the digits after a decimal point, keeping as many as fit (like Go's
/// `leadingFraction`): returns the digits as an integer and the power of ten they scale by.
fn leading_fraction(s: &[u8]) -> (u64, f64, &[u8]) {
    let mut value: u64 = 0;
    let mut scale = 1f64;
    let mut overflow = false;
    let mut i = 0;
    while i < s.len() && s[i].is_ascii_digit() {
        if !overflow {
            if value > (i64::MAX as u64) / 10 {
                overflow = true;
            } else {
                let next = value * 10 + u64::from(s[i] - b'0');
                if next > 1u64 << 63 {
                    overflow = true;
                } else {
                    value = next;
                    scale *= 10.0;
                }
            }
        }
        i += 1;
    }
    (value, scale, &s[i..])
}

/// Appends `.ddd` for `frac` (which has `prec` decimal digits), dropping trailing zeros and
/// the point itself when nothing remains — Go's `fmtFrac`.
fn push_fraction(out: &mut String, frac: u64, prec: u32) {
    if frac == 0 {
        return;
    }
    let digits = format!("{frac:0width$}", width = prec as usize);
    out.push('.');
    out.push_str(digits.trim_end_matches('0'));
}

impl fmt::Display for GoDuration {
    /// Formats exactly like Go's `time.Duration.String()`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let magnitude = self.0.unsigned_abs();
        if magnitude == 0 {
            return f.write_str("0s");
        }
        let mut out = String::with_capacity(24);
        if self.0 < 0 {
            out.push('-');
        }
        if magnitude < NANOS_PER_SECOND as u64 {
            let (prec, unit) = match magnitude {
                0..1_000 => (0, "ns"),
                1_000..1_000_000 => (3, "µs"),
                _ => (6, "ms"),
            };
            let div = 10u64.pow(prec);
            out.push_str(&(magnitude / div).to_string());
            push_fraction(&mut out, magnitude % div, prec);
            out.push_str(unit);
        } else {
            let secs = magnitude / NANOS_PER_SECOND as u64;
            let minutes = secs / 60;
            let hours = minutes / 60;
            if hours > 0 {
                out.push_str(&format!("{hours}h"));
            }
            if minutes > 0 {
                out.push_str(&format!("{}m", minutes % 60));
            }
            out.push_str(&(secs % 60).to_string());
            push_fraction(&mut out, magnitude % NANOS_PER_SECOND as u64, 9);
            out.push('s');
        }
        f.write_str(&out)
    }
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    /// Only strings are accepted, as with `metav1.Duration` (a bare number is an error).
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = GoDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"30s\" or \"1m30s\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<GoDuration, E> {
                GoDuration::parse(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}
