//! Decoding concurrent answers together: one decode loop per loaded model, which takes
//! every answer in flight one token further per step with one batched forward pass
//! ([`tuneq_trainer::model::Llama::forward_cached_rows`]), so eight streams cost far
//! less than eight times one.
//!
//! An answer joins the loop between steps: its prompt fills its own cache (the others
//! wait that long), then it steps with the rest until it ends, and leaves. The caller
//! waits on its own thread, receiving the answer's pieces through a channel; when it
//! stops listening (a stream's client left), the answer leaves the loop at the next step.
//! The loop's thread holds the model only while it has answers; when its
//! [`ServedModel`](crate::engine::ServedModel) is dropped (evicted, unused) the loop
//! ends with it.

use crate::error::{Result, ServeError};
use crate::generation::{Decoding, Generated, GenerationRequest, Next, Piece};
use crate::model::LoadedModel;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// An answer in the loop: its decoding state, its cache, the token to feed next.
struct Active {
    job: Job,
    decoding: Decoding,
    cache: KvCache,
    next: u32,
}

/// One model's decode loop.
#[derive(Debug)]
pub(crate) struct Batcher {
    jobs: mpsc::Sender<Job>,
    /// The most answers one step has taken so far.
    widest: Arc<std::sync::atomic::AtomicUsize>,
}

impl Batcher {
    /// Starts the loop, stepping at most `max_rows` answers at once (more wait their turn).
    pub(crate) fn start(max_rows: usize) -> Result<Self> {
        let (jobs, queue) = mpsc::channel();
        let widest = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = widest.clone();
        std::thread::Builder::new()
            .name("tuneq-decode".into())
            .spawn(move || run(&queue, max_rows.max(1), &seen))
            .map_err(|e| ServeError::Load(format!("cannot start the decode loop: {e}")))?;
        Ok(Self { jobs, widest })
    }

    /// The most answers one step has taken so far.
    pub(crate) fn widest_step(&self) -> usize {
        self.widest.load(Ordering::Relaxed)
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

/// The loop: admit waiting answers, step them all, until the model is gone.
fn run(queue: &mpsc::Receiver<Job>, max_rows: usize, widest: &std::sync::atomic::AtomicUsize) {
    let mut active: Vec<Active> = Vec::new();
    loop {
        if active.is_empty() {
            match queue.recv() {
                Ok(job) => admit(&mut active, job),
                Err(_) => return,
            }
        }
        while active.len() < max_rows {
            match queue.try_recv() {
                Ok(job) => admit(&mut active, job),
                Err(_) => break,
            }
        }
        if !active.is_empty() {
            widest.fetch_max(active.len(), Ordering::Relaxed);
            step(&mut active);
        }
    }
}

/// Fills a new answer's cache with its prompt and picks its first token.
fn admit(active: &mut Vec<Active>, job: Job) {
    let _span = tracing::debug_span!("admit", prompt = job.request.prompt.len()).entered();
    let started = Decoding::start(&job.model, job.request.clone()).and_then(|decoding| {
        let mut cache = job.model.model.new_cache();
        let logits = job
            .model
            .model
            .forward_cached(decoding.prompt(), &mut cache)?;
        Ok((decoding, cache, logits))
    });
    let (mut decoding, cache, logits) = match started {
        Ok(started) => started,
        Err(e) => return job.done(Err(e)),
    };
    match decoding.step(&job.model, &logits, cache.len(), &mut |p| job.send(p)) {
        Ok(Next::Feed(next)) => active.push(Active {
            job,
            decoding,
            cache,
            next,
        }),
        Ok(Next::Done(finish)) => {
            let result = decoding.finish(finish, &mut |p| job.send(p));
            job.done(result);
        }
        Err(e) => job.done(Err(e)),
    }
}

/// One token further for every answer, in one forward pass; the finished leave.
fn step(active: &mut Vec<Active>) {
    let model = active[0].job.model.clone();
    let ids: Vec<u32> = active.iter().map(|a| a.next).collect();
    let mut caches: Vec<&mut KvCache> = active.iter_mut().map(|a| &mut a.cache).collect();
    let logits = match model.model.forward_cached_rows(&ids, &mut caches) {
        Ok(logits) => logits,
        Err(e) => {
            tracing::error!(error = %e, rows = ids.len(), "a decode step failed");
            for a in active.drain(..) {
                a.job.done(Err(ServeError::Decode(e.to_string())));
            }
            return;
        }
    };
    let mut kept = Vec::with_capacity(active.len());
    for (row, mut a) in active.drain(..).enumerate() {
        let outcome = logits.get(row).map_err(ServeError::from).and_then(|l| {
            let job = &a.job;
            a.decoding
                .step(&job.model, &l, a.cache.len(), &mut |p| job.send(p))
        });
        match outcome {
            Ok(Next::Feed(next)) => {
                a.next = next;
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
}
