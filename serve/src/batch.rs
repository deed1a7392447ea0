//! Decoding concurrent answers together: one decode loop per loaded model, which takes
//! every answer in flight one token further per pass with one batched forward pass
//! ([`tuneq_trainer::model::Llama::forward_cached_spans`]), so eight streams cost far
//! less than eight times one.
//!
//! An answer joins the loop between passes: its prompt fills its cache in the next
//! passes, beside the next token of every answer in flight (and the prompts of the
//! others that joined with it), so the weights are read once for all of them. A pass
//! takes a bounded number of prompt tokens — fewer while answers are being decoded — so
//! a long prompt fills in chunks rather than stalling every answer in flight for its
//! whole length. Once its prompt is in, an answer steps with the rest until it ends, and
//! leaves. The caller waits on its own thread, receiving the answer's pieces through a
//! channel; when it stops listening (a stream's client left),
//! the answer leaves the loop at the next pass. The loop's thread holds the model only
//! while it has answers; when its [`ServedModel`](crate::engine::ServedModel) is dropped
//! (evicted, unused) the loop ends with it.

use crate::error::{Result, ServeError};
use crate::generation::{Decoding, Generated, GenerationRequest, Next, Piece};
use crate::model::LoadedModel;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use tuneq_trainer::model::KvCache;

/// What the loop tells the waiting caller.
enum Event {
    /// Text released.
    Piece(Piece),
    /// The answer, or why there is none.
    Done(Result<Generated>),
}

/// An answer handed to the loop.
struct Job {
    model: Arc<LoadedModel>,
    request: GenerationRequest,
    events: mpsc::Sender<Event>,
    /// Set by the caller when it stops listening.
    left: Arc<AtomicBool>,
}

impl Job {
    /// Hands a piece to the caller; false once it stopped listening.
    fn send(&self, piece: Piece) -> bool {
        !self.left.load(Ordering::Relaxed) && self.events.send(Event::Piece(piece)).is_ok()
    }

    fn done(&self, result: Result<Generated>) {
        let _ = self.events.send(Event::Done(result));
    }
}

/// An answer in the loop: its decoding state, its cache, the tokens to feed (its prompt
/// when it joins, then the token it just picked) and how many of them are in the cache.
struct Active {
    job: Job,
    decoding: Decoding,
    cache: KvCache,
    feed: Vec<u32>,
    fed: usize,
}

impl Active {
    /// Whether its prompt is still filling its cache (no token picked yet).
    fn filling(&self) -> bool {
        self.cache.len() < self.decoding.prompt().len()
    }
}

/// Prompt tokens one pass takes at most while no answer is being decoded: bounds a
/// pass's activations; a longer prompt fills in several passes.
const PROMPT_TOKENS_PER_PASS: usize = 2048;

/// Prompt tokens one pass takes at most while answers are being decoded: how long the
/// answers in flight wait for a joining prompt, per token they make (on SmolLM2 with two
/// cores, about 0.4 s for a pass of this many rows against 40 ms for eight answers'
/// steps alone).
const PROMPT_TOKENS_WHILE_DECODING: usize = 256;

/// What a decode loop has done, for tests and operators.
#[derive(Debug, Default)]
struct LoopStats {
    /// The most answers one pass has taken.
    widest: AtomicUsize,
    /// Passes that left a prompt partly filled (it went on in the next pass).
    chunked: AtomicUsize,
}

/// What every decode loop of an engine has done together, for `/metrics`: passes, the
/// answers they stepped, and the passes that left a prompt partly filled.
#[derive(Debug, Default)]
pub struct DecodeTotals {
    passes: AtomicU64,
    rows: AtomicU64,
    chunked: AtomicU64,
}

impl DecodeTotals {
    /// Passes run.
    pub fn passes(&self) -> u64 {
        self.passes.load(Ordering::Relaxed)
    }

    /// Answers stepped, summed over the passes (over `passes`: the mean batch).
    pub fn rows(&self) -> u64 {
        self.rows.load(Ordering::Relaxed)
    }

    /// Passes that left a prompt partly filled.
    pub fn chunked(&self) -> u64 {
        self.chunked.load(Ordering::Relaxed)
    }

    fn record(&self, rows: usize, chunked: bool) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.rows.fetch_add(rows as u64, Ordering::Relaxed);
        if chunked {
            self.chunked.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One model's decode loop.
#[derive(Debug)]
pub(crate) struct Batcher {
    jobs: mpsc::Sender<Job>,
    stats: Arc<LoopStats>,
}

impl Batcher {
    /// Starts the loop, stepping at most `max_rows` answers at once (more wait their turn),
    /// counting its passes into `totals` too.
    pub(crate) fn start(max_rows: usize, totals: Arc<DecodeTotals>) -> Result<Self> {
        let (jobs, queue) = mpsc::channel();
        let stats = Arc::new(LoopStats::default());
        let seen = stats.clone();
        std::thread::Builder::new()
            .name("tuneq-decode".into())
            .spawn(move || run(&queue, max_rows.max(1), (&seen, &totals)))
            .map_err(|e| ServeError::Load(format!("cannot start the decode loop: {e}")))?;
        Ok(Self { jobs, stats })
    }

    /// The most answers one step has taken so far.
    pub(crate) fn widest_step(&self) -> usize {
        self.stats.widest.load(Ordering::Relaxed)
    }

    /// Passes so far that left a prompt partly filled.
    pub(crate) fn chunked_passes(&self) -> usize {
        self.stats.chunked.load(Ordering::Relaxed)
    }

    /// Generates `request` with `model` in the loop, handing pieces to `on_piece` on
    /// this thread; blocks until the answer is done.
    pub(crate) fn generate(
        &self,
        model: Arc<LoadedModel>,
        request: &GenerationRequest,
        on_piece: &mut dyn FnMut(Piece) -> bool,
    ) -> Result<Generated> {
        let (events, answers) = mpsc::channel();
        let left = Arc::new(AtomicBool::new(false));
        let job = Job {
            model,
            request: request.clone(),
            events,
            left: left.clone(),
        };
        self.jobs
            .send(job)
            .map_err(|_| ServeError::Load("the decode loop has stopped".into()))?;
        for event in answers {
            match event {
                Event::Piece(piece) => {
                    if !on_piece(piece) {
                        left.store(true, Ordering::Relaxed);
                        return Err(ServeError::Abandoned);
                    }
                }
                Event::Done(result) => return result,
            }
        }
        Err(ServeError::Load(
            "the decode loop stopped mid-answer".into(),
        ))
    }
}

/// The loop: let waiting answers join, pass over them all, until the model is gone.
fn run(queue: &mpsc::Receiver<Job>, max_rows: usize, (stats, totals): (&LoopStats, &DecodeTotals)) {
    let mut active: Vec<Active> = Vec::new();
    let mut waiting: VecDeque<Job> = VecDeque::new();
    loop {
        if active.is_empty() && waiting.is_empty() {
            match queue.recv() {
                Ok(job) => waiting.push_back(job),
                Err(_) => return,
            }
        }
        // The engine's generation slots bound how many answers can be queued here.
        waiting.extend(queue.try_iter());
        join(&mut waiting, &mut active, max_rows);
        // Answers whose callers left while their prompts filled (nothing was sent to
        // tell) leave before the pass.
        active.retain(|a| !a.job.left.load(Ordering::Relaxed));
        if !active.is_empty() {
            let rows = active.len();
            stats.widest.fetch_max(rows, Ordering::Relaxed);
            let chunked = pass(&mut active);
            if chunked {
                stats.chunked.fetch_add(1, Ordering::Relaxed);
            }
            totals.record(rows, chunked);
        }
    }
}

/// Moves waiting answers into the loop while there is room (at most `max_rows`
/// answers); an answer whose caller already left is dropped, one that cannot start (its
/// prompt past the context, an unusable JSON schema) is answered with why.
fn join(waiting: &mut VecDeque<Job>, active: &mut Vec<Active>, max_rows: usize) {
    while active.len() < max_rows {
        let Some(job) = waiting.pop_front() else {
            return;
        };
        if job.left.load(Ordering::Relaxed) {
            continue;
        }
        match Decoding::start(&job.model, job.request.clone()) {
            Ok(decoding) => active.push(Active {
                feed: decoding.prompt().to_vec(),
                fed: 0,
                cache: job.model.model.new_cache(),
                job,
                decoding,
            }),
            Err(e) => job.done(Err(e)),
        }
    }
}

/// How many tokens of its feed each answer brings to the next pass: one for an answer
/// being decoded; for prompts, in the order they joined, what the pass's prompt budget
/// leaves (0: it waits for the next pass).
fn takes(active: &[Active]) -> Vec<usize> {
    let mut budget = match active.iter().any(|a| !a.filling()) {
        true => PROMPT_TOKENS_WHILE_DECODING,
        false => PROMPT_TOKENS_PER_PASS,
    };
    active
        .iter()
        .map(|a| {
            let left = a.feed.len() - a.fed;
            if !a.filling() {
                return left;
            }
            let take = left.min(budget);
            budget -= take;
            take
        })
        .collect()
}

/// One pass: every answer's tokens to feed (a chunk of a joining prompt, or the last
/// token picked) in one forward pass; then each answer whose feed is all in picks its
/// next token; the finished leave. Whether a prompt was left partly filled.
fn pass(active: &mut Vec<Active>) -> bool {
    let model = active[0].job.model.clone();
    let takes = takes(active);
    let (spans, mut caches): (Vec<&[u32]>, Vec<&mut KvCache>) = active
        .iter_mut()
        .zip(&takes)
        .filter(|(_, take)| **take > 0)
        .map(|(a, take)| (&a.feed[a.fed..a.fed + take], &mut a.cache))
        .unzip();
    let rows: usize = spans.iter().map(|s| s.len()).sum();
    let _span = tracing::debug_span!("decode_pass", answers = spans.len(), rows).entered();
    let logits = match model.model.forward_cached_spans(&spans, &mut caches) {
        Ok(logits) => logits,
        Err(e) => {
            tracing::error!(error = %e, rows, "a decode pass failed");
            for a in active.drain(..) {
                a.job.done(Err(ServeError::Decode(e.to_string())));
            }
            return false;
        }
    };
    let mut kept = Vec::with_capacity(active.len());
    let mut row = 0;
    let mut chunked = false;
    for (mut a, take) in active.drain(..).zip(takes) {
        a.fed += take;
        if take == 0 || a.fed < a.feed.len() {
            // Its prompt is still filling: no token to pick yet.
            chunked |= take > 0;
            row += usize::from(take > 0);
            kept.push(a);
            continue;
        }
        let outcome = logits.get(row).map_err(ServeError::from).and_then(|l| {
            let job = &a.job;
            a.decoding
                .step(&job.model, &l, a.cache.len(), &mut |p| job.send(p))
        });
        row += 1;
        match outcome {
            Ok(Next::Feed(next)) => {
                a.feed.clear();
                a.feed.push(next);
                a.fed = 0;
                kept.push(a);
            }
            Ok(Next::Done(finish)) => {
                let Active { job, decoding, .. } = a;
                let result = decoding.finish(finish, &mut |p| job.send(p));
                job.done(result);
            }
            Err(ServeError::Abandoned) => {}
            Err(e) => a.job.done(Err(e)),
        }
    }
    *active = kept;
    chunked
}
