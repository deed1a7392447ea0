//! A streamed answer. The decode loop hands its pieces to an [`AnswerSink`]: chat
//! completions' is [`ChunkWriter`] — `data: {chat.completion.chunk}` events exactly as
//! OpenAI's SDKs read them: a first chunk with the role, content chunks, the tool calls
//! whole at the end, a chunk with the finish reason, a usage chunk when asked for, and
//! `data: [DONE]`; the Responses API's is in [`super::responses`]. An answer that may
//! be a bare tool call is held back until it shows whether it is one ([`super::holdback`]).
//!
//! Generation runs on a blocking thread and hands chunks to the response through a
//! small bounded channel: a slow reader slows generation rather than piling chunks up
//! in memory, and a reader that leaves closes the channel, which stops generation and
//! gives the slot back.

use super::answer;
use super::holdback::BareCallHold;
use super::request::{ChatPlan, ToolMode};
use super::{Inference, Prepared, Stamp};
use actix_web::HttpResponse;
use std::sync::Arc;
use tokio::sync::mpsc;
use tuneq_openapi::{
    ChatCompletionChunk, ChunkChoice, ChunkDelta, ChunkToolCall, ErrorBody, Usage,
};
use tuneq_serve::reasoning::{Part, ReasoningStream};
use tuneq_serve::{ServeError, Slot};

/// Chunks waiting for the reader at most.
const CHANNEL_CHUNKS: usize = 16;

/// Where a streamed answer goes, event by event: chat chunks ([`ChunkWriter`]) or the
/// Responses API's events. Each call says whether the reader is still there.
pub(super) trait AnswerSink {
    /// Whether the reader is still there.
    fn alive(&self) -> bool;
    /// Choice `index` begins.
    fn open(&mut self, index: u32) -> bool;
    /// Text of choice `index` is released (with its tokens' log-probabilities).
    fn text(&mut self, index: u32, piece: tuneq_serve::Piece) -> bool;
    /// Reasoning of choice `index` is released ([`tuneq_serve::reasoning`]).
    fn reasoning(&mut self, index: u32, piece: tuneq_serve::Piece) -> bool;
    /// Choice `index` ends: the text the stream has not shown of it yet, its reading.
    fn close(&mut self, index: u32, unshown: Option<String>, reading: &answer::Reading) -> bool;
    /// Every choice is done.
    fn done(&mut self, usage: Usage) -> bool;
    /// Generation failed; the stream ends with this error.
    fn fail(&mut self, error: crate::error::ApiError);
}

/// Sends server-sent events to the response.
pub(super) struct EventSender {
    tx: mpsc::Sender<bytes::Bytes>,
}

impl EventSender {
    /// Sends raw event text; false when the reader has left.
    pub(super) fn send(&self, text: String) -> bool {
        self.tx.blocking_send(bytes::Bytes::from(text)).is_ok()
    }

    /// Whether the reader is still there.
    pub(super) fn alive(&self) -> bool {
        !self.tx.is_closed()
    }
}

/// Starts generating `plan`'s answer into the sink `make_sink` makes, and answers with
/// the stream.
pub(super) fn respond<S: AnswerSink + 'static>(
    inference: Arc<Inference>,
    slot: Slot,
    prepared: Prepared,
    plan: ChatPlan,
    tenant: String,
    span: tracing::Span,
    make_sink: impl FnOnce(EventSender) -> S + Send + 'static,
) -> HttpResponse {
    let (tx, rx) = mpsc::channel::<bytes::Bytes>(CHANNEL_CHUNKS);
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let _entered = span.enter();
        let mut sink = make_sink(EventSender { tx });
        if let Some(usage) = generate(&mut sink, &prepared, &plan) {
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

/// Generates every choice into `sink`; the request's usage, unless the reader left or
/// generation failed.
fn generate(sink: &mut dyn AnswerSink, prepared: &Prepared, plan: &ChatPlan) -> Option<Usage> {
    // Text is streamed as it comes unless the request forces a call: then the whole
    // answer is read before anything is sent.
    let streams_text = matches!(plan.tools, ToolMode::Off | ToolMode::Auto);
    let mut completion = 0;
    for index in 0..plan.n {
        if !sink.open(index) {
            return None;
        }
        let auto = plan.tools == ToolMode::Auto;
        let mut hold = BareCallHold::new(auto.then(|| plan.tool_names.clone()));
        let mut thinking = ReasoningStream::new(prepared.reasons);
        let generated = {
            let mut on_piece = |piece: tuneq_serve::Piece| {
                if !streams_text || (piece.text.is_empty() && piece.logprobs.is_empty()) {
                    return sink.alive();
                }
                deliver(sink, &mut hold, index, thinking.push(piece))
            };
            prepared
                .model
                .generate(&prepared.request(plan, index), &mut on_piece)
        };
        let generated = match generated {
            Ok(generated) => generated,
            Err(ServeError::Abandoned) => return None,
            Err(e) => {
                sink.fail(super::serve_error(e));
                return None;
            }
        };
        completion += generated.tokens as u64;
        if streams_text && !deliver(sink, &mut hold, index, thinking.finish()) {
            return None;
        }
        // An answer that may be a bare call was held back until now (`holdback`).
        let reading = answer::read(plan, &prepared.prefill, &generated, prepared.reasons);
        let bare_call = reading.tool_calls.is_some() && generated.after_marker.is_none();
        if !bare_call
            && !hold
                .release()
                .into_iter()
                .all(|piece| sink.text(index, piece))
        {
            return None;
        }
        let unshown = match (&reading.tool_calls, streams_text) {
            (Some(_), _) => None,
            // Text after a call's opening that did not read as a call.
            (None, true) => generated.after_marker.clone(),
            (None, false) => reading.content.clone(),
        };
        if !sink.close(index, unshown.filter(|t| !t.is_empty()), &reading) {
            return None;
        }
    }
    let usage = super::usage(prepared, completion);
    sink.done(usage).then_some(usage)
}

/// Sends `parts` of choice `index` on: reasoning to the sink, content through the
/// bare-call hold; false when the reader has left.
fn deliver(
    sink: &mut dyn AnswerSink,
    hold: &mut BareCallHold,
    index: u32,
    parts: Vec<Part>,
) -> bool {
    parts.into_iter().all(|part| match part {
        Part::Reasoning(piece) => sink.reasoning(index, piece),
        Part::Content(piece) => hold
            .push(piece)
            .into_iter()
            .all(|piece| sink.text(index, piece)),
    })
}

/// Chat completion chunks.
pub(super) struct ChunkWriter {
    events: EventSender,
    stamp: Stamp,
    model: String,
    logprobs: bool,
    include_usage: bool,
}

impl ChunkWriter {
    /// Chunks of the answer to `plan`.
    pub(super) fn new(events: EventSender, plan: &ChatPlan) -> Self {
        Self {
            events,
            stamp: Stamp::new(),
            model: plan.model.clone(),
            logprobs: plan.logprobs.is_some(),
            include_usage: plan.include_usage,
        }
    }

    /// Sends one `data:` event.
    fn data(&self, json: &str) -> bool {
        self.events.send(format!("data: {json}\n\n"))
    }

    /// Sends a chunk with `choices` (and `usage`).
    fn chunk(&self, choices: Vec<ChunkChoice>, usage: Option<Usage>) -> bool {
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

    /// Sends the delta a released piece makes, with its tokens' log-probabilities when
    /// the request asked for them.
    fn released(
        &self,
        index: u32,
        delta: ChunkDelta,
        tokens: &[tuneq_serve::TokenLogprob],
    ) -> bool {
        let logprobs = self.logprobs.then(|| answer::logprobs(tokens));
        self.delta(index, delta, logprobs, None)
    }
}

impl AnswerSink for ChunkWriter {
    fn alive(&self) -> bool {
        self.events.alive()
    }

    fn open(&mut self, index: u32) -> bool {
        let opening = ChunkDelta {
            role: Some("assistant".into()),
            content: Some(String::new()),
            ..ChunkDelta::default()
        };
        self.delta(index, opening, None, None)
    }

    fn text(&mut self, index: u32, piece: tuneq_serve::Piece) -> bool {
        let delta = ChunkDelta {
            content: Some(piece.text),
            ..ChunkDelta::default()
        };
        self.released(index, delta, &piece.logprobs)
    }

    fn reasoning(&mut self, index: u32, piece: tuneq_serve::Piece) -> bool {
        let delta = ChunkDelta {
            reasoning_content: Some(piece.text),
            ..ChunkDelta::default()
        };
        self.released(index, delta, &piece.logprobs)
    }

    fn close(&mut self, index: u32, unshown: Option<String>, reading: &answer::Reading) -> bool {
        if let Some(text) = unshown {
            let delta = ChunkDelta {
                content: Some(text),
                ..ChunkDelta::default()
            };
            if !self.delta(index, delta, None, None) {
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
            if !self.delta(index, delta, None, None) {
                return false;
            }
        }
        self.delta(index, ChunkDelta::default(), None, Some(reading.finish))
    }

    fn done(&mut self, usage: Usage) -> bool {
        if self.include_usage && !self.chunk(Vec::new(), Some(usage)) {
            return false;
        }
        self.data("[DONE]")
    }

    /// Ends the stream with an error event, as OpenAI's stream does (the SDK raises it).
    fn fail(&mut self, error: crate::error::ApiError) {
        let body = ErrorBody {
            error: *error.detail,
        };
        if let Ok(json) = serde_json::to_string(&body) {
            self.data(&json);
        }
    }
}
