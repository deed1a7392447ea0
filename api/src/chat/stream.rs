//! A streamed answer: `data: {chat.completion.chunk}` events as the text is released,
//! exactly as OpenAI's SDKs read them — a first chunk with the role, content chunks, the
//! tool calls whole at the end, a chunk with the finish reason, a usage chunk when asked
//! for, and `data: [DONE]`.
//!
//! Generation runs on a blocking thread and hands chunks to the response through a
//! small bounded channel: a slow reader slows generation rather than piling chunks up
//! in memory, and a reader that leaves closes the channel, which stops generation and
//! gives the slot back.

use super::answer;
use super::request::{ChatPlan, ToolMode};
use super::{Inference, Prepared, Stamp};
use actix_web::HttpResponse;
use std::sync::Arc;
use tokio::sync::mpsc;
use tuneq_openapi::{ChatCompletionChunk, ChunkChoice, ChunkDelta, ChunkToolCall, ErrorBody};
use tuneq_serve::{ServeError, Slot};

/// Chunks waiting for the reader at most.
const CHANNEL_CHUNKS: usize = 16;

/// Starts generating `plan`'s answer and answers with its stream.
pub(super) fn respond(
    inference: Arc<Inference>,
    slot: Slot,
    prepared: Prepared,
    plan: ChatPlan,
    tenant: String,
    span: tracing::Span,
) -> HttpResponse {
    let (tx, rx) = mpsc::channel::<bytes::Bytes>(CHANNEL_CHUNKS);
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let _entered = span.enter();
        let writer = ChunkWriter {
            tx,
            stamp: Stamp::new(),
            model: plan.model.clone(),
        };
        if let Some(usage) = generate(&writer, &prepared, &plan) {
            inference.count(&tenant, usage);
        }
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((Ok::<_, actix_web::Error>(chunk), rx))
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header((actix_web::http::header::CACHE_CONTROL, "no-cache"))
        .insert_header(("x-accel-buffering", "no"))
        .streaming(body)
}

/// Writes chunks to the response.
struct ChunkWriter {
    tx: mpsc::Sender<bytes::Bytes>,
    stamp: Stamp,
    model: String,
}

impl ChunkWriter {
    /// Sends one `data:` event; false when the reader has left.
    fn data(&self, json: &str) -> bool {
        self.tx
            .blocking_send(bytes::Bytes::from(format!("data: {json}\n\n")))
            .is_ok()
    }

    /// Sends a chunk with `choices` (and `usage`).
    fn chunk(&self, choices: Vec<ChunkChoice>, usage: Option<tuneq_openapi::Usage>) -> bool {
        let chunk = ChatCompletionChunk {
            id: self.stamp.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.stamp.created,
            model: self.model.clone(),
            system_fingerprint: self.stamp.fingerprint.clone(),
            choices,
            usage,
        };
        serde_json::to_string(&chunk).is_ok_and(|json| self.data(&json))
    }

    /// Sends one choice's delta.
    fn delta(
        &self,
        index: u32,
        delta: ChunkDelta,
        logprobs: Option<tuneq_openapi::ChoiceLogprobs>,
        finish_reason: Option<tuneq_openapi::FinishReason>,
    ) -> bool {
        let choice = ChunkChoice {
            index,
            delta,
            logprobs,
            finish_reason,
        };
        self.chunk(vec![choice], None)
    }

    /// Ends the stream with an error event, as OpenAI's stream does (the SDK raises it).
    fn error(&self, error: crate::error::ApiError) {
        let body = ErrorBody {
            error: *error.detail,
        };
        if let Ok(json) = serde_json::to_string(&body) {
            self.data(&json);
        }
    }
}

/// Generates and sends every choice; the request's usage, unless the reader left or
/// generation failed.
fn generate(w: &ChunkWriter, prepared: &Prepared, plan: &ChatPlan) -> Option<tuneq_openapi::Usage> {
    // Text is streamed as it comes unless the request forces a call: then the whole
    // answer is read before anything is sent.
    let streams_text = matches!(plan.tools, ToolMode::Off | ToolMode::Auto);
    let mut completion = 0;
    for index in 0..plan.n {
        let opening = ChunkDelta {
            role: Some("assistant".into()),
            content: Some(String::new()),
            tool_calls: None,
        };
        if !w.delta(index, opening, None, None) {
            return None;
        }
        let mut on_piece = |piece: tuneq_serve::Piece| {
            if !streams_text || (piece.text.is_empty() && piece.logprobs.is_empty()) {
                return !w.tx.is_closed();
            }
            let delta = ChunkDelta {
                content: Some(piece.text),
                ..ChunkDelta::default()
            };
            let logprobs = plan.logprobs.map(|_| answer::logprobs(&piece.logprobs));
            w.delta(index, delta, logprobs, None)
        };
        let generated = match prepared
            .model
            .generate(&prepared.request(plan, index), &mut on_piece)
        {
            Ok(generated) => generated,
            Err(ServeError::Abandoned) => return None,
            Err(e) => {
                w.error(super::serve_error(e));
                return None;
            }
        };
        completion += generated.tokens as u64;
        let reading = answer::read(plan, &prepared.prefill, &generated, false);
        if !finish_choice(w, index, &generated, &reading, streams_text) {
            return None;
        }
    }
    let usage = super::usage(prepared, completion);
    if plan.include_usage && !w.chunk(Vec::new(), Some(usage)) {
        return None;
    }
    w.data("[DONE]").then_some(usage)
}

/// Sends what the stream has not shown of a choice (text held for a call that was not
/// one, or the tool calls) and its finish reason.
fn finish_choice(
    w: &ChunkWriter,
    index: u32,
    generated: &tuneq_serve::Generated,
    reading: &answer::Reading,
    streamed_text: bool,
) -> bool {
    let unshown = match (&reading.tool_calls, streamed_text) {
        (Some(_), _) => None,
        // Text after a call's opening that did not read as a call.
        (None, true) => generated.after_marker.clone(),
        (None, false) => reading.content.clone(),
    };
    if let Some(text) = unshown.filter(|t| !t.is_empty()) {
        let delta = ChunkDelta {
            content: Some(text),
            ..ChunkDelta::default()
        };
        if !w.delta(index, delta, None, None) {
            return false;
        }
    }
    if let Some(calls) = &reading.tool_calls {
        let calls = calls
            .iter()
            .enumerate()
            .map(|(i, call)| ChunkToolCall {
                index: i as u32,
                id: call.id.clone(),
                kind: call.kind.clone(),
                function: call.function.clone(),
            })
            .collect();
        let delta = ChunkDelta {
            tool_calls: Some(calls),
            ..ChunkDelta::default()
        };
        if !w.delta(index, delta, None, None) {
            return false;
        }
    }
    w.delta(index, ChunkDelta::default(), None, Some(reading.finish))
}
