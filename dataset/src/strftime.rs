//! `strftime_now(format)`, the function transformers gives chat templates: Llama 3.1 and
//! 3.2 write "Today Date: 26 Jul 2024" into every system header with
//! `strftime_now("%d %b %Y")`, and fall back to that fixed date where the function is
//! missing. tuneq writes the date as transformers does on a machine whose clock is UTC.
//!
//! The directives are Python's for the C locale; one tuneq does not know is an error
//! naming it, never a silently different text.

use std::time::{SystemTime, UNIX_EPOCH};

const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A moment in UTC, broken into what the directives print.
struct Moment {
    year: i64,
    /// 1–12.
    month: u32,
    /// 1–31.
    day: u32,
    /// 1–366.
    day_of_year: u32,
    /// 0 = Monday.
    weekday: usize,
    hour: u32,
    minute: u32,
    second: u32,
}

impl Moment {
    /// The moment `seconds` after the Unix epoch (proleptic Gregorian calendar).
    fn at(seconds: i64) -> Self {
        let days = seconds.div_euclid(86_400);
        let in_day = seconds.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        let january_first = days_from_civil(year, 1, 1);
        Self {
            year,
            month,
            day,
            day_of_year: (days - january_first + 1) as u32,
            // 1970-01-01 was a Thursday.
            weekday: (days + 3).rem_euclid(7) as usize,
            hour: in_day / 3600,
            minute: in_day / 60 % 60,
            second: in_day % 60,
        }
    }
}

/// Year, month, day of the day `days` after 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Days from 1970-01-01 to the date (the inverse of [`civil_from_days`]).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let month = i64::from(month);
    let doy = (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `format` written for the moment `seconds` after the Unix epoch, UTC, or the
/// directive that is not known.
pub(crate) fn format_at(format: &str, seconds: i64) -> Result<String, String> {
    let m = Moment::at(seconds);
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(directive) = chars.next() else {
            return Err("a format that ends with a lone '%'".into());
        };
        let month = MONTHS[m.month as usize - 1];
        let weekday = WEEKDAYS[m.weekday];
        let hour12 = match m.hour % 12 {
            0 => 12,
            h => h,
        };
        let text = match directive {
            'd' => format!("{:02}", m.day),
            'e' => format!("{:2}", m.day),
            'm' => format!("{:02}", m.month),
            'b' | 'h' => month[..3].to_string(),
            'B' => month.to_string(),
            'Y' => m.year.to_string(),
            'y' => format!("{:02}", m.year.rem_euclid(100)),
            'a' => weekday[..3].to_string(),
            'A' => weekday.to_string(),
            'w' => ((m.weekday + 1) % 7).to_string(),
            'u' => (m.weekday + 1).to_string(),
            'j' => format!("{:03}", m.day_of_year),
            'H' => format!("{:02}", m.hour),
            'I' => format!("{hour12:02}"),
            'p' => if m.hour < 12 { "AM" } else { "PM" }.to_string(),
            'M' => format!("{:02}", m.minute),
            'S' => format!("{:02}", m.second),
            'F' => format!("{}-{:02}-{:02}", m.year, m.month, m.day),
            'T' => format!("{:02}:{:02}:{:02}", m.hour, m.minute, m.second),
            'Z' => "UTC".to_string(),
            'z' => "+0000".to_string(),
            '%' => "%".to_string(),
            other => {
                return Err(format!(
                    "the directive %{other}, which tuneq does not write"
                ));
            }
        };
        out.push_str(&text);
    }
    Ok(out)
}

/// `format` written for now, UTC.
pub(crate) fn format_now(format: &str) -> Result<String, String> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    format_at(format, now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_read_as_python_writes_them() {
        // 2024-07-26 12:34:56 UTC, a Friday: the date Llama 3.1's template falls back to.
        let t = 1_721_997_296;
        assert_eq!(format_at("%d %b %Y", t).as_deref(), Ok("26 Jul 2024"));
        assert_eq!(
            format_at("%A %B %e, %y %H:%M:%S %p %j %w %u %%", t).as_deref(),
            Ok("Friday July 26, 24 12:34:56 PM 208 5 5 %")
        );
        assert_eq!(
            format_at("%F %T %Z", 0).as_deref(),
            Ok("1970-01-01 00:00:00 UTC")
        );
        // A leap day, a year's last day, the day before the epoch.
        assert_eq!(
            format_at("%F %j %a", 951_782_400).as_deref(),
            Ok("2000-02-29 060 Tue")
        );
        assert_eq!(
            format_at("%F %j", 1_735_603_200).as_deref(),
            Ok("2024-12-31 366")
        );
        assert_eq!(
            format_at("%F %a %I", -1).as_deref(),
            Ok("1969-12-31 Wed 11")
        );
    }

    #[test]
    fn an_unknown_directive_is_named() {
        assert!(format_at("%Q", 0).expect_err("unknown").contains("%Q"));
        assert!(format_at("50%", 0).is_err());
    }

    #[test]
    fn every_day_round_trips() {
        for days in -800_000..800_000 {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }
}
