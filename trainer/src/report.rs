//! [`Reporter`]: a [`ProgressSink`] that posts events to the control plane.
//!
//! A trainer started by a dispatcher gets a report URL and its attempt's credential.
//! Events are batched by a background thread and posted as numbered reports (a repeated
//! report is recorded once, so a lost reply is simply sent again). Training never waits
//! on the network, except at the end, when the last events (the `finished` one above
//! all) are delivered before the process exits. If the control plane answers 410, this
//! attempt was superseded, preempted or cancelled: the process stops at once, writing
//! nothing more, because another attempt may own the output now.

use crate::progress::ProgressSink;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tuneq_openapi::{AttemptReport, TrainEvent};

/// Exit status of a trainer whose attempt was superseded (the launch contract's).
pub use tuneq_openapi::launch::EXIT_SUPERSEDED;

/// How long events are gathered before a report is sent.
const BATCH_WINDOW: Duration = Duration::from_millis(500);
/// How long the end of a run waits for its last report to be delivered.
const FINAL_DELIVERY: Duration = Duration::from_secs(60);

enum Message {
    Event(Box<TrainEvent>),
    Close,
}

/// Posts events to `<url>` with `Authorization: Bearer <credential>`.
pub struct Reporter {
    sender: mpsc::Sender<Message>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl Reporter {
    /// Starts the background poster.
    pub fn new(url: String, credential: String) -> std::io::Result<Self> {
        let (sender, receiver) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("tuneq-report".into())
            .spawn(move || post_loop(&url, &credential, &receiver))?;
        Ok(Self {
            sender,
            worker: Some(worker),
        })
    }
}

impl ProgressSink for Reporter {
    fn event(&mut self, event: &TrainEvent) {
        let _ = self.sender.send(Message::Event(Box::new(event.clone())));
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        let _ = self.sender.send(Message::Close);
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// Outcome of one post.
enum Posted {
    Delivered,
    Superseded,
    Failed(String),
}

fn post_loop(url: &str, credential: &str, receiver: &mpsc::Receiver<Message>) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tuneq-report: cannot start: {e}");
            return;
        }
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap_or_default();
    let post = |report: &AttemptReport| -> Posted {
        runtime.block_on(async {
            match client
                .post(url)
                .bearer_auth(credential)
                .json(report)
                .send()
                .await
            {
                Ok(r) if r.status().is_success() => Posted::Delivered,
                Ok(r) if r.status() == reqwest::StatusCode::GONE => Posted::Superseded,
                Ok(r) => {
                    let status = r.status();
                    Posted::Failed(format!("{status}: {}", r.text().await.unwrap_or_default()))
                }
                Err(e) => Posted::Failed(e.to_string()),
            }
        })
    };
    let mut seq = 0u64;
    let mut pending: Vec<TrainEvent> = Vec::new();
    let mut closing = false;
    let mut failures = 0u32;
    let mut closed_at: Option<Instant> = None;
    loop {
        // Gather what arrives within the window (or until the run ends).
        let deadline = Instant::now() + BATCH_WINDOW;
        while !closing {
            let left = deadline.saturating_duration_since(Instant::now());
            match receiver.recv_timeout(left) {
                Ok(Message::Event(e)) => pending.push(*e),
                Ok(Message::Close) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                    closing = true;
                    closed_at = Some(Instant::now());
                }
                Err(mpsc::RecvTimeoutError::Timeout) => break,
            }
        }
        if !pending.is_empty() {
            seq += 1;
            let report = AttemptReport {
                seq,
                events: std::mem::take(&mut pending),
            };
            // The same report (same number) is sent until it is delivered.
            loop {
                match post(&report) {
                    Posted::Delivered => {
                        failures = 0;
                        break;
                    }
                    Posted::Superseded => {
                        eprintln!(
                            "tuneq-report: this attempt was superseded or cancelled; stopping"
                        );
                        std::process::exit(EXIT_SUPERSEDED);
                    }
                    Posted::Failed(why) => {
                        failures += 1;
                        eprintln!("tuneq-report: report {seq} not delivered ({why}); retrying");
                        let give_up = closed_at.is_some_and(|t| t.elapsed() > FINAL_DELIVERY);
                        if give_up {
                            eprintln!("tuneq-report: giving up on report {seq}");
                            break;
                        }
                        let pause = Duration::from_millis(200u64 << failures.min(5));
                        std::thread::sleep(pause);
                        // While training goes on, newer events join the next report.
                        if !closing {
                            break_into_next(&mut pending, receiver, &mut closing);
                            if closing {
                                closed_at = Some(Instant::now());
                            }
                        }
                    }
                }
            }
        }
        if closing && pending.is_empty() {
            return;
        }
    }
}

/// Moves events that arrived meanwhile into `pending` without waiting.
fn break_into_next(
    pending: &mut Vec<TrainEvent>,
    receiver: &mpsc::Receiver<Message>,
    closing: &mut bool,
) {
    loop {
        match receiver.try_recv() {
            Ok(Message::Event(e)) => pending.push(*e),
            Ok(Message::Close) | Err(mpsc::TryRecvError::Disconnected) => {
                *closing = true;
                return;
            }
            Err(mpsc::TryRecvError::Empty) => return,
        }
    }
}
