//! How fast one source may try keys. Every authentication (a tenant key or the admin key)
//! asks [`Throttle::admit`] *before* the key is looked up, so a source that has used up
//! its failures is answered 429 whether the key it sends is right or wrong: the answer
//! says nothing about the key, and guessing goes no faster than the refill rate.
//!
//! Each source has a bucket of [`BURST`] failure credits that refills at one credit per
//! [`REFILL`]. A lookup holds a credit while it is in flight (so a burst of concurrent
//! guesses cannot spend one credit many times over) and gives it back when the key was
//! right; a wrong key spends it. A source is a client address, with IPv6 addresses
//! grouped by their /64 (one host is usually given a whole /64, so one address each
//! would not bound anything). So from one source at most `BURST + t / REFILL` wrong keys
//! are answered in `t` seconds — 30 at once, then one every 2 s — in each API process.
//!
//! Keys are also throttled by their prefix ([`Source::KeyPrefix`]: the first
//! [`PREFIX_CHARS`] characters sent), with the same buckets: a guesser who knows part of
//! a key (a truncated log line) and spreads its tries over many addresses still gets
//! `BURST + t / REFILL` tries at that key. Random guesses have random prefixes and are
//! bounded by their source.
//!
//! A busy client behind the same address as a guesser is slowed with it: that is the
//! price of not telling right from wrong. Sources are kept at most [`SOURCES`] (full
//! buckets are dropped first), so no client can grow this table without a bound.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failures a source may have at once before it is refused.
pub const BURST: u32 = 30;
/// How long a spent failure credit takes to come back.
pub const REFILL: Duration = Duration::from_secs(2);
/// Sources tracked at most.
const SOURCES: usize = 10_000;
/// Characters of a key its prefix bucket is named by (after a `tq_`, 52 of its 160
/// random bits: a tenant's prefix is not guessable, so no one can spend it for them).
pub const PREFIX_CHARS: usize = 16;

/// Where a request comes from, as far as guessing is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// One IPv4 address.
    V4(u32),
    /// An IPv6 /64 (the upper 64 bits); IPv4-mapped addresses count as IPv4.
    V6(u64),
    /// The keys that start alike: a keyed hash of their first [`PREFIX_CHARS`]
    /// characters (the table never holds key material).
    KeyPrefix(u64),
}

impl Source {
    /// The prefix bucket of `key`.
    pub fn key_prefix(key: &str) -> Self {
        use std::hash::{BuildHasher, Hasher};
        // One random hashing key per process: a prefix cannot be read back from the table.
        static HASHING: std::sync::OnceLock<std::collections::hash_map::RandomState> =
            std::sync::OnceLock::new();
        let mut hasher = HASHING.get_or_init(Default::default).build_hasher();
        let end = key
            .char_indices()
            .nth(PREFIX_CHARS)
            .map_or(key.len(), |(i, _)| i);
        hasher.write(&key.as_bytes()[..end]);
        Source::KeyPrefix(hasher.finish())
    }
}

impl From<IpAddr> for Source {
    fn from(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Source::V4(v4.into()),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source::V4(v4.into()),
                None => Source::V6((u128::from(v6) >> 64) as u64),
            },
        }
    }
}

#[derive(Debug)]
struct Bucket {
    /// Credits left at `at`, spent ones not yet refilled.
    credits: f64,
    at: Instant,
    /// Lookups holding a credit now.
    in_flight: u32,
}

impl Bucket {
    fn full(now: Instant) -> Self {
        Bucket {
            credits: f64::from(BURST),
            at: now,
            in_flight: 0,
        }
    }

    fn refill(&mut self, now: Instant) {
        let gained = now.duration_since(self.at).as_secs_f64() / REFILL.as_secs_f64();
        self.credits = (self.credits + gained).min(f64::from(BURST));
        self.at = now;
    }

    fn is_idle_and_full(&self) -> bool {
        self.in_flight == 0 && self.credits >= f64::from(BURST)
    }
}

/// The failure buckets of one process.
#[derive(Debug, Default)]
pub struct Throttle {
    buckets: Mutex<HashMap<Source, Bucket>>,
}

/// A source out of credits: retry after this many seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttled {
    /// Whole seconds until the source has a credit again (at least 1).
    pub retry_after: u64,
}

impl Throttle {
    /// Lets one authentication of `source` go ahead, holding one of its credits until
    /// the returned pass says how it went; or refuses it while the source has none.
    pub fn admit(&self, source: Source) -> Result<Pass<'_>, Throttled> {
        self.admit_at(source, Instant::now())
    }

    fn admit_at(&self, source: Source, now: Instant) -> Result<Pass<'_>, Throttled> {
        let Ok(mut buckets) = self.buckets.lock() else {
            // A panic while the lock was held (none of the code under it panics):
            // refusing everyone would lock every tenant out.
            return Ok(Pass {
                throttle: self,
                source,
                settled: true,
            });
        };
        if buckets.len() >= SOURCES && !buckets.contains_key(&source) {
            buckets.retain(|_, b| {
                b.refill(now);
                !b.is_idle_and_full()
            });
            if buckets.len() >= SOURCES {
                // Every tracked source is guessing at once: forget the idle ones.
                buckets.retain(|_, b| b.in_flight > 0);
            }
        }
        let bucket = buckets.entry(source).or_insert_with(|| Bucket::full(now));
        bucket.refill(now);
        let free = bucket.credits - f64::from(bucket.in_flight);
        if free < 1.0 {
            let wait = (1.0 - free) * REFILL.as_secs_f64();
            return Err(Throttled {
                retry_after: (wait.ceil() as u64).max(1),
            });
        }
        bucket.in_flight += 1;
        Ok(Pass {
            throttle: self,
            source,
            settled: false,
        })
    }

    fn settle(&self, source: Source, failed: bool) {
        if let Ok(mut buckets) = self.buckets.lock()
            && let Some(bucket) = buckets.get_mut(&source)
        {
            bucket.in_flight = bucket.in_flight.saturating_sub(1);
            if failed {
                bucket.credits -= 1.0;
            }
        }
    }
}

/// One admitted authentication. Say how it went with [`Pass::succeeded`] or
/// [`Pass::failed`]; dropped unsaid (the client hung up mid-lookup), it gives its credit
/// back.
#[derive(Debug)]
#[must_use = "say whether the key was right"]
pub struct Pass<'a> {
    throttle: &'a Throttle,
    source: Source,
    settled: bool,
}

impl Pass<'_> {
    /// The key was right: the credit comes back.
    pub fn succeeded(mut self) {
        self.settled = true;
        self.throttle.settle(self.source, false);
    }

    /// The key was wrong: the credit is spent.
    pub fn failed(mut self) {
        self.settled = true;
        self.throttle.settle(self.source, true);
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.throttle.settle(self.source, false);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn v4(last: u8) -> Source {
        Source::from(IpAddr::from([192, 0, 2, last]))
    }

    #[test]
    fn a_source_out_of_credits_is_refused_even_before_a_right_key_is_looked_up() {
        let throttle = Throttle::default();
        let now = Instant::now();
        for _ in 0..BURST {
            throttle.admit_at(v4(1), now).unwrap().failed();
        }
        // The next one is refused whatever key it carries: admit runs before the lookup.
        let refused = throttle.admit_at(v4(1), now).unwrap_err();
        assert_eq!(refused.retry_after, REFILL.as_secs());
        // Another source is not affected.
        throttle.admit_at(v4(2), now).unwrap().succeeded();
        // One credit comes back per REFILL.
        throttle.admit_at(v4(1), now + REFILL).unwrap().failed();
        assert!(throttle.admit_at(v4(1), now + REFILL).is_err());
    }

    #[test]
    fn concurrent_lookups_each_hold_a_credit() {
        let throttle = Throttle::default();
        let now = Instant::now();
        let passes: Vec<_> = (0..BURST)
            .map(|_| throttle.admit_at(v4(1), now).unwrap())
            .collect();
        assert!(
            throttle.admit_at(v4(1), now).is_err(),
            "a burst of concurrent guesses cannot share credits"
        );
        for pass in passes {
            pass.succeeded();
        }
        // Right keys gave their credits back.
        for _ in 0..BURST {
            throttle.admit_at(v4(1), now).unwrap().succeeded();
        }
    }

    #[test]
    fn guesses_per_second_are_bounded_by_the_refill() {
        let throttle = Throttle::default();
        let start = Instant::now();
        let mut answered = 0;
        // 100 seconds of a guesser trying every 10 ms.
        for tick in 0..10_000u32 {
            let now = start + Duration::from_millis(u64::from(tick) * 10);
            if let Ok(pass) = throttle.admit_at(v4(1), now) {
                pass.failed();
                answered += 1;
            }
        }
        let bound = BURST + (100.0 / REFILL.as_secs_f64()) as u32;
        assert!(
            answered <= bound,
            "{answered} guesses answered, bound {bound}"
        );
        assert!(answered >= bound - 1, "the refill works: {answered}");
    }

    #[test]
    fn ipv6_addresses_of_one_slash_64_are_one_source() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::from(a), Source::from(b));
        assert_ne!(Source::from(a), Source::from(c));
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(Source::from(mapped), v4(1));
    }

    #[test]
    fn a_dropped_pass_gives_its_credit_back() {
        let throttle = Throttle::default();
        let now = Instant::now();
        for _ in 0..BURST * 2 {
            drop(throttle.admit_at(v4(1), now).unwrap());
        }
        assert!(throttle.admit_at(v4(1), now).is_ok());
    }

    #[test]
    fn keys_sharing_a_prefix_share_a_bucket() {
        let known = "tq_0123456789abcdef";
        assert_eq!(
            Source::key_prefix(&format!("{known}0000")),
            Source::key_prefix(&format!("{known}ffff"))
        );
        assert_ne!(
            Source::key_prefix("tq_0123456789a00000"),
            Source::key_prefix("tq_0123456789b00000")
        );
        // Short and multi-byte keys are fine.
        assert_eq!(Source::key_prefix("é"), Source::key_prefix("é"));
    }

    #[test]
    fn the_table_stays_bounded() {
        let throttle = Throttle::default();
        let now = Instant::now();
        for i in 0..(SOURCES as u32 + 500) {
            throttle.admit_at(Source::V4(i), now).unwrap().succeeded();
        }
        assert!(throttle.buckets.lock().unwrap().len() <= SOURCES);
    }
}
