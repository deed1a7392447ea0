//! Where progress goes: the [`ProgressSink`] interface and its two standard sinks.
//!
//! The trainer never prints directly; it reports [`TrainEvent`]s to a sink. By default
//! they are JSON lines on stdout (machine-readable, what the control plane parses); when
//! stdout is a terminal a progress bar with loss and ETA is shown instead.

use std::io::Write;
use tuneq_openapi::TrainEvent;

/// Receives every event of a training run, in order.
pub trait ProgressSink: Send {
    /// Handles one event. Sinks must not fail the run: they log and carry on.
    fn event(&mut self, event: &TrainEvent);
}

/// Writes each event as one JSON line.
pub struct JsonLines<W: Write + Send> {
    out: W,
}

impl<W: Write + Send> JsonLines<W> {
    /// A sink writing to `out`.
    pub fn new(out: W) -> Self {
        Self { out }
    }
}

impl<W: Write + Send> ProgressSink for JsonLines<W> {
    fn event(&mut self, event: &TrainEvent) {
        if let Ok(line) = serde_json::to_string(event) {
            // A closed stdout must not stop training; the files in the output are the record.
            let _ = writeln!(self.out, "{line}");
            let _ = self.out.flush();
        }
    }
}

/// A progress bar with loss, learning rate and ETA, for people at a terminal.
pub struct TerminalBar {
    bar: Option<indicatif::ProgressBar>,
}

impl TerminalBar {
    /// A bar that appears once training starts.
    pub fn new() -> Self {
        Self { bar: None }
    }
}

impl Default for TerminalBar {
    fn default() -> Self {
        Self::new()
    }
}

impl ProgressSink for TerminalBar {
    fn event(&mut self, event: &TrainEvent) {
        match event {
            TrainEvent::Started {
                total_steps,
                start_step,
                train_examples,
                dataset_format,
                ..
            } => {
                let bar = indicatif::ProgressBar::new(*total_steps);
                if let Ok(style) = indicatif::ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} steps  {msg}  ETA {eta}",
                ) {
                    bar.set_style(style);
                }
                bar.set_position(*start_step);
                bar.println(format!(
                    "training on {train_examples} {dataset_format} examples, {total_steps} steps"
                ));
                self.bar = Some(bar);
            }
            TrainEvent::Step(m) => {
                if let Some(bar) = &self.bar {
                    bar.set_position(m.step);
                    bar.set_message(format!(
                        "loss {:.4}  lr {:.2e}  {:.0} tok/s",
                        m.loss, m.lr, m.tokens_per_s
                    ));
                }
            }
            other => {
                let text = match other {
                    TrainEvent::Resumed { step, checkpoint } => {
                        format!("resumed at step {step} from {checkpoint}")
                    }
                    TrainEvent::Eval {
                        step,
                        validation_loss,
                        ..
                    } => format!("step {step}: validation loss {validation_loss:.4}"),
                    TrainEvent::Checkpoint { step, location } => {
                        format!("checkpoint at step {step}: {location}")
                    }
                    TrainEvent::Sample {
                        prompt, completion, ..
                    } => format!("sample: {prompt:?} → {completion:?}"),
                    TrainEvent::Warning { message } => format!("warning: {message}"),
                    TrainEvent::EarlyStopped {
                        stopped_at,
                        best_step,
                        best_validation_loss,
                    } => match stopped_at {
                        Some(at) => format!(
                            "early stopping at step {at}: keeping step {best_step} (validation loss {best_validation_loss:.4})"
                        ),
                        None => format!(
                            "keeping the best validated step, {best_step} (validation loss {best_validation_loss:.4})"
                        ),
                    },
                    TrainEvent::Interrupted { step } => {
                        format!("interrupted; checkpoint at step {step} written")
                    }
                    TrainEvent::Finished {
                        adapter,
                        validation_loss,
                        ..
                    } => match validation_loss {
                        Some(v) => format!("done: adapter at {adapter} (validation loss {v:.4})"),
                        None => format!("done: adapter at {adapter}"),
                    },
                    _ => return,
                };
                match &self.bar {
                    Some(bar) => bar.println(text),
                    None => eprintln!("{text}"),
                }
                if matches!(
                    other,
                    TrainEvent::Finished { .. } | TrainEvent::Interrupted { .. }
                ) && let Some(bar) = self.bar.take()
                {
                    bar.finish_and_clear();
                }
            }
        }
    }
}

/// Forwards every event to several sinks.
pub struct Tee(pub Vec<Box<dyn ProgressSink>>);

impl ProgressSink for Tee {
    fn event(&mut self, event: &TrainEvent) {
        for s in &mut self.0 {
            s.event(event);
        }
    }
}
