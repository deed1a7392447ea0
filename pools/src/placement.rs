//! Placement: which pools a job may run on, in which order, and what it would cost —
//! pure functions of the pools file, the job's needs and what has happened to the job,
//! so every rule is a table test.
//!
//! At create ([`plan`]): the pools offering the hardware class the job asks for, minus
//! those whose memory cannot hold the attempt, minus those whose estimated cost exceeds
//! the job's `max_cost`; a job left with none is refused with the numbers. The list is
//! ordered spot first (the job allows it: checkpoints make a preemption cost minutes),
//! then GPU before CPU, then by price, then as the file lists them.
//!
//! At each attempt ([`usable`], [`choose`]): the job's list minus pools it has been
//! preempted on `preemptions_before_fallback` times within the window, or has waited
//! for a node past the placement timeout; then the first with a free slot.

use crate::file::{Hardware, PlacementSettings, Pool, PoolsFile};

/// What a job needs from a pool.
#[derive(Debug, Clone, Default)]
pub struct Needs<'a> {
    /// The hardware class asked for: `any`, `cpu`, `gpu`, `spot-cpu`, `spot-gpu`.
    pub class: &'a str,
    /// Memory its training needs on a CPU pool (None: the model's shape is not known
    /// here, and the trainer checks).
    pub memory_bytes: Option<u64>,
    /// Accelerator memory its training needs on a GPU pool (None: as `memory_bytes`).
    pub accelerator_memory_bytes: Option<u64>,
    /// Tokens it will train on (examples' tokens × epochs), for estimates.
    pub tokens: Option<u64>,
    /// The most it may cost.
    pub max_cost: Option<f64>,
}

/// What a job would take on a pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// Training time, in seconds (without queueing or preemptions).
    pub seconds: f64,
    /// `seconds` at the pool's price per hour.
    pub cost: f64,
}

/// A pool a job may run on.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<'a> {
    /// The pool.
    pub pool: &'a Pool,
    /// Its estimate, when the job's tokens and the pool's speed are known.
    pub estimate: Option<Estimate>,
}

/// Why no pool can take a job.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    /// No pool offers the hardware class.
    #[error("No node pool offers hardware `{asked}`; this service has: {offered}.")]
    NoHardware {
        /// The class asked for.
        asked: String,
        /// The classes offered, comma-separated.
        offered: String,
    },
    /// Every pool of the class is too small.
    #[error(
        "This job needs about {} MiB (weights, LoRA with optimiser state, and activations for its batch × sequence length), more than any pool it may run on holds (the largest, {largest_pool}, has {} MiB); lower batch_size, max_seq_len or lora.r.",
        needed >> 20,
        largest >> 20
    )]
    DoesNotFit {
        /// Bytes needed.
        needed: u64,
        /// The roomiest pool.
        largest_pool: String,
        /// Its bytes.
        largest: u64,
    },
    /// Every pool that fits would cost more than the job allows.
    #[error(
        "This job would cost about {cheapest:.2} on {cheapest_pool} (its cheapest pool), more than its max_cost of {max_cost:.2}."
    )]
    OverBudget {
        /// The job's limit.
        max_cost: f64,
        /// The cheapest pool's estimate.
        cheapest: f64,
        /// The cheapest pool.
        cheapest_pool: String,
    },
}

impl Refusal {
    /// The request field to blame.
    pub fn field(&self) -> &'static str {
        match self {
            Self::NoHardware { .. } => "hardware",
            Self::DoesNotFit { .. } => "hyperparameters.batch_size",
            Self::OverBudget { .. } => "max_cost",
        }
    }
}

/// Whether `pool` offers the hardware class `class`.
pub fn offers(pool: &Pool, class: &str) -> bool {
    match class {
        "any" => true,
        "cpu" => pool.hardware == Hardware::Cpu,
        "gpu" => pool.hardware == Hardware::Gpu,
        "spot-cpu" | "spot-gpu" => pool.class() == class,
        _ => false,
    }
}

/// The estimate for `tokens` on `pool` at `tokens_per_second`.
pub fn estimate(pool: &Pool, tokens: u64, tokens_per_second: f64) -> Option<Estimate> {
    if !(tokens_per_second.is_finite() && tokens_per_second > 0.0) {
        return None;
    }
    let seconds = tokens as f64 / tokens_per_second;
    Some(Estimate {
        seconds,
        cost: seconds / 3600.0 * pool.price_per_hour,
    })
}

/// The pools a job may run on, best first, or why there is none. `speed` gives a
/// pool's measured tokens per second (None: use the file's `tokens_per_second`).
pub fn plan<'a>(
    file: &'a PoolsFile,
    needs: &Needs<'_>,
    speed: &dyn Fn(&str) -> Option<f64>,
) -> Result<Vec<Candidate<'a>>, Refusal> {
    let of_class: Vec<&Pool> = file
        .pools
        .iter()
        .filter(|p| offers(p, needs.class))
        .collect();
    if of_class.is_empty() {
        let mut offered: Vec<&str> = file.pools.iter().map(Pool::class).collect();
        offered.sort_unstable();
        offered.dedup();
        return Err(Refusal::NoHardware {
            asked: needs.class.to_string(),
            offered: if offered.is_empty() {
                "none".into()
            } else {
                offered.join(", ")
            },
        });
    }
    let needed_on = |p: &Pool| match p.hardware {
        // An attempt runs a compute thread per core of the pool.
        Hardware::Cpu => needs
            .memory_bytes
            .map(|m| m + crate::memory::thread_scratch_bytes(p.cpu.millis().div_ceil(1000))),
        Hardware::Gpu => needs.accelerator_memory_bytes.or(needs.memory_bytes),
    };
    let fits = |p: &Pool| match (needed_on(p), p.training_memory_bytes()) {
        (Some(needed), Some(has)) => has >= needed,
        _ => true,
    };
    let fitting: Vec<&Pool> = of_class.iter().copied().filter(|p| fits(p)).collect();
    if fitting.is_empty() {
        // Every pool of the class has a known memory and a known need above it.
        let largest = of_class
            .iter()
            .max_by_key(|p| p.training_memory_bytes())
            .copied()
            .unwrap_or(of_class[0]);
        return Err(Refusal::DoesNotFit {
            needed: needed_on(largest).unwrap_or_default(),
            largest_pool: largest.name.clone(),
            largest: largest.training_memory_bytes().unwrap_or_default(),
        });
    }
    let mut candidates: Vec<Candidate<'a>> = fitting
        .into_iter()
        .map(|pool| Candidate {
            pool,
            estimate: needs.tokens.and_then(|tokens| {
                let tps = speed(&pool.name).or(pool.tokens_per_second)?;
                estimate(pool, tokens, tps)
            }),
        })
        .collect();
    if let Some(max_cost) = needs.max_cost {
        let within: Vec<Candidate<'a>> = candidates
            .iter()
            .filter(|c| c.estimate.is_none_or(|e| e.cost <= max_cost))
            .cloned()
            .collect();
        if within.is_empty() {
            let cheapest = candidates
                .iter()
                .filter_map(|c| c.estimate.map(|e| (c.pool.name.clone(), e.cost)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap_or_default();
            return Err(Refusal::OverBudget {
                max_cost,
                cheapest: cheapest.1,
                cheapest_pool: cheapest.0,
            });
        }
        candidates = within;
    }
    // A stable sort keeps the file's order among equals.
    candidates.sort_by(|a, b| {
        b.pool
            .spot
            .cmp(&a.pool.spot)
            .then((a.pool.hardware == Hardware::Cpu).cmp(&(b.pool.hardware == Hardware::Cpu)))
            .then(a.pool.price_per_hour.total_cmp(&b.pool.price_per_hour))
    });
    Ok(candidates)
}

/// What has happened to a job on a pool, as placement counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Setback {
    /// Its attempt was preempted there at `at_ms`.
    Preempted {
        /// The pool.
        pool: String,
        /// When (ms since the epoch).
        at_ms: u64,
    },
    /// Its attempt waited for a node past the pool's placement timeout.
    NoCapacity {
        /// The pool.
        pool: String,
    },
}

/// The pools of `list` (the job's, best first) its next attempt may use: without those
/// it was preempted on `preemptions_before_fallback` times within the window, or found
/// no node on. The last pool of the list is never taken away: a job always has
/// somewhere to wait.
pub fn usable(
    list: &[String],
    setbacks: &[Setback],
    settings: &PlacementSettings,
    now_ms: u64,
) -> Vec<String> {
    let window_ms = settings.preemption_window.as_millis() as u64;
    let avoided = |pool: &str| {
        let preemptions = setbacks
            .iter()
            .filter(|s| matches!(s, Setback::Preempted { pool: p, at_ms } if p == pool && now_ms.saturating_sub(*at_ms) <= window_ms))
            .count();
        preemptions >= settings.preemptions_before_fallback as usize
            || setbacks
                .iter()
                .any(|s| matches!(s, Setback::NoCapacity { pool: p } if p == pool))
    };
    let kept: Vec<String> = list.iter().filter(|p| !avoided(p)).cloned().collect();
    if kept.is_empty() {
        list.last().cloned().into_iter().collect()
    } else {
        kept
    }
}

/// The first pool of `usable` with a free slot.
pub fn choose<'a>(usable: &'a [String], free_slots: &dyn Fn(&str) -> u32) -> Option<&'a str> {
    usable
        .iter()
        .map(String::as_str)
        .find(|p| free_slots(p) > 0)
}
