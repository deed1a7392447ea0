//! [`Reporter`]: a [`ProgressSink`] that posts events to the control plane.
//!
//! A trainer started by a dispatcher gets a report URL and its attempt's credential.
//! Events are batched by a background thread and posted as numbered reports (a repeated
//! report is recorded once, so a lost reply is simply sent again). Training never waits
//! on the network, except at the end, when the last events (the `finished` one above
//! all) are delivered before the process exits. If the control plane answers 410, this
//! attempt was superseded, preempted or cancelled: the reporter calls the `superseded`
//! hook its owner gave it (the `tuneq train` binary exits with
//! [`tuneq_openapi::launch::EXIT_SUPERSEDED`] there, writing nothing more, because another
//! attempt may own the output now) and posts nothing further. When a delivered report's
//! answer asks for a checkpoint and a stop (the tenant paused the job), the reporter
//! sets the run's [`StopFlag`], as SIGTERM does: the run checkpoints and ends
//! interrupted, and the job waits paused.

use crate::progress::ProgressSink;
use crate::train::StopFlag;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tuneq_openapi::{AttemptReport, AttemptReportAnswer, TrainEvent};

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
    /// Starts the background poster; `superseded` runs (on its thread) when the control
    /// plane says this attempt is no longer live, and `stop` is set when it asks for a
    /// checkpoint and a stop.
    pub fn new(
        url: String,
        credential: String,
        stop: StopFlag,
        superseded: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<Self> {
        let (sender, receiver) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("tuneq-report".into())
            .spawn(move || {
                if post_loop(&url, &credential, &stop, &receiver) == Delivery::Superseded {
                    superseded();
                }
            })?;
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

/// How the reports of a run went.
#[derive(Debug, PartialEq, Eq)]
enum Delivery {
    /// Delivered, or given up on after the run ended.
    Done,
    /// The control plane answered 410: this attempt is no longer live.
    Superseded,
}

/// Posts reports to the control plane, from the reporter's thread.
struct Poster<'a> {
    runtime: tokio::runtime::Runtime,
    client: reqwest::Client,
    url: &'a str,
    credential: &'a str,
    stop: &'a StopFlag,
}

impl Poster<'_> {
    /// Posts one report; an answer that asks for a checkpoint and a stop sets the run's
    /// stop flag.
    fn post(&self, report: &AttemptReport) -> Posted {
        self.runtime.block_on(async {
            let sent = self
                .client
                .post(self.url)
                .bearer_auth(self.credential)
                .json(report)
                .send()
                .await;
            match sent {
                Ok(r) if r.status().is_success() => {
                    // An answer that does not read (an older control plane's 204) asks
                    // for nothing.
                    let answer: AttemptReportAnswer = r.json().await.unwrap_or_default();
                    if answer.checkpoint_and_stop && !self.stop.is_set() {
                        eprintln!("tuneq-report: the job was paused; checkpointing and stopping");
                        self.stop.set();
                    }
                    Posted::Delivered
                }
                Ok(r) if r.status() == reqwest::StatusCode::GONE => Posted::Superseded,
                Ok(r) => {
                    let status = r.status();
                    Posted::Failed(format!("{status}: {}", r.text().await.unwrap_or_default()))
                }
                Err(e) => Posted::Failed(e.to_string()),
            }
        })
    }
}

fn post_loop(
    url: &str,
    credential: &str,
    stop: &StopFlag,
    receiver: &mpsc::Receiver<Message>,
) -> Delivery {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tuneq-report: cannot start: {e}");
            return Delivery::Done;
        }
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap_or_default();
    let poster = Poster {
        runtime,
        client,
        url,
        credential,
        stop,
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
                match poster.post(&report) {
                    Posted::Delivered => {
                        failures = 0;
                        break;
                    }
                    Posted::Superseded => {
                        eprintln!(
                            "tuneq-report: this attempt was superseded or cancelled; stopping"
                        );
                        return Delivery::Superseded;
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
            return Delivery::Done;
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A control plane on loopback answering every report with `status` and `body`;
    /// counts them.
    fn control_plane(status: &'static str, body: &'static str) -> (String, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/report", listener.local_addr().unwrap());
        let posts = Arc::new(AtomicUsize::new(0));
        let counted = posts.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                // Headers, then the body its content-length announces.
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request);
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length: ")
                                    .map(str::to_string)
                            })
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if request.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                counted.fetch_add(1, Ordering::SeqCst);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        (url, posts)
    }

    /// Posts one report to `url`: whether the superseded hook ran, and whether the
    /// run was asked to stop.
    fn run(url: String) -> (bool, bool) {
        let called = Arc::new(AtomicBool::new(false));
        let flag = called.clone();
        let stop = StopFlag::new();
        let mut reporter = Reporter::new(url, "credential".into(), stop.clone(), move || {
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
        reporter.event(&TrainEvent::Warning {
            message: "hello".into(),
        });
        drop(reporter);
        (called.load(Ordering::SeqCst), stop.is_set())
    }

    #[test]
    fn a_410_calls_the_superseded_hook_and_a_delivered_report_does_not() {
        let (url, posts) = control_plane("410 Gone", "");
        assert!(run(url).0, "a 410 must reach the owner's hook");
        assert_eq!(
            posts.load(Ordering::SeqCst),
            1,
            "nothing is posted after a 410"
        );
        let (url, posts) = control_plane("204 No Content", "");
        assert_eq!(run(url), (false, false));
        assert_eq!(posts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_answer_that_asks_for_a_checkpoint_and_a_stop_sets_the_runs_stop_flag() {
        let (url, _) = control_plane("200 OK", r#"{"checkpoint_and_stop":true}"#);
        assert_eq!(run(url), (false, true), "a pause stops the run");
        let (url, _) = control_plane("200 OK", r#"{"checkpoint_and_stop":false}"#);
        assert_eq!(run(url), (false, false));
    }
}
