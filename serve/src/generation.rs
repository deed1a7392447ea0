//! One answer: the decode loop from a prompt's ids to text, piece by piece.
//!
//! The prompt fills a key/value cache once; then each token costs one token's forward
//! pass. Each token is picked by the [`Sampler`], turned into text by the
//! [`Detokenizer`] and watched by [`StopText`]; the caller sees each piece of text as it
//! is released (to stream it) and may stop listening.

use crate::error::{Result, ServeError};
use crate::model::LoadedModel;
use crate::sampling::{Sampler, Sampling, log_softmax, top_k};
use crate::text::{Detokenizer, StopText};
use candle_core::Tensor;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// The prompt's ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// How tokens are picked.
    pub sampling: Sampling,
    /// The seed of the sampler's stream.
    pub seed: u64,
    /// Strings that end the answer (left out of it).
    pub stop: Vec<String>,
    /// Strings that end the answer's plain text, the rest kept apart (tool calls).
    pub markers: Vec<String>,
    /// Log-probabilities to report per token: None, or the number of alternatives.
    pub logprobs: Option<usize>,
    /// What the answer must be (JSON, tool calls), enforced token by token.
    pub format: Option<crate::json_format::AnswerFormat>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model ended its turn, or a stop string appeared.
    Stop,
    /// `max_new_tokens` or the context ran out.
    Length,
}

/// A token's log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability under the model.
    pub logprob: f32,
    /// The most likely tokens at its position, with theirs.
    pub top: Vec<(String, f32)>,
}

/// A piece of the answer, as it is released.
#[derive(Debug, Clone, Default)]
pub struct Piece {
    /// Text to show (may be empty while text is held back).
    pub text: String,
    /// The log-probabilities of the tokens generated since the last piece.
    pub logprobs: Vec<TokenLogprob>,
}

/// The whole answer.
#[derive(Debug, Clone)]
pub struct Generated {
    /// The answer's plain text, up to a stop string or marker.
    pub text: String,
    /// The text from a marker on, when one appeared.
    pub after_marker: Option<String>,
    /// Why it ended.
    pub finish: Finish,
    /// Tokens generated.
    pub tokens: usize,
    /// Per token, when asked for.
    pub logprobs: Vec<TokenLogprob>,
}

/// What the decode loop does after a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Feed this token to the model and call [`Decoding::step`] with its logits.
    Feed(u32),
    /// The answer is over.
    Done(Finish),
}

/// One answer being decoded: everything but the model's forward pass, so that one
/// loop can decode an answer alone ([`LoadedModel::generate_alone`]) and the batcher
/// many together.
pub(crate) struct Decoding {
    request: GenerationRequest,
    sampler: Sampler,
    detok: Detokenizer,
    watch: StopText,
    constraint: Option<crate::json_format::JsonConstraint>,
    logprobs: Vec<TokenLogprob>,
    tokens: usize,
}

impl Decoding {
    /// Starts decoding `request` with `model` (checks the prompt against the context
    /// and compiles its answer's format, if any).
    pub(crate) fn start(model: &LoadedModel, request: GenerationRequest) -> Result<Self> {
        let context = model.context_length();
        if request.prompt.is_empty() || request.prompt.len() >= context {
            return Err(ServeError::PromptTooLong {
                tokens: request.prompt.len(),
                context,
            });
        }
        let constraint = match &request.format {
            Some(format) => Some(model.json_grammars()?.constrain(format)?),
            None => None,
        };
        Ok(Self {
            sampler: Sampler::new(request.sampling.clone(), request.seed),
            detok: Detokenizer::default(),
            watch: StopText::new(request.stop.clone(), request.markers.clone()),
            constraint,
            logprobs: Vec::new(),
            tokens: 0,
            request,
        })
    }

    /// The prompt to fill the cache with.
    pub(crate) fn prompt(&self) -> &[u32] {
        &self.request.prompt
    }

    /// Picks the token after `logits` (the model's after `cached` tokens), releases its
    /// text to `on_piece`, and says what comes next. [`ServeError::Abandoned`] when
    /// `on_piece` says the client left.
    pub(crate) fn step(
        &mut self,
        model: &LoadedModel,
        logits: &Tensor,
        cached: usize,
        on_piece: &mut dyn FnMut(Piece) -> bool,
    ) -> Result<Next> {
        if self.constraint.as_ref().is_some_and(|c| c.is_done()) {
            return Ok(Next::Done(Finish::Stop));
        }
        if self.tokens == self.request.max_new_tokens || cached >= model.context_length() {
            return Ok(Next::Done(Finish::Length));
        }
        let mut row = logits.to_vec1::<f32>()?;
        // The model's own distribution, before any constraint.
        let reported = self.request.logprobs.map(|k| (log_softmax(&row), k));
        if let Some(c) = self.constraint.as_mut() {
            c.mask(&mut row)?;
        }
        let next = self.sampler.pick(&mut row);
        if let Some(c) = self.constraint.as_mut() {
            c.accept(next)?;
        }
        self.tokens += 1;
        if model.stop_ids.contains(&next) {
            return Ok(Next::Done(Finish::Stop));
        }
        let mut piece = Piece {
            text: self.watch.push(&self.detok.push(&model.encoder, next)?),
            logprobs: Vec::new(),
        };
        if let Some((lp, k)) = reported {
            let logprob = model.token_logprob(next, &lp, k)?;
            self.logprobs.push(logprob.clone());
            piece.logprobs.push(logprob);
        }
        if !on_piece(piece) {
            return Err(ServeError::Abandoned);
        }
        Ok(match self.watch.stopped() {
            true => Next::Done(Finish::Stop),
            false => Next::Feed(next),
        })
    }

    /// Ends the answer: releases the text held back for a stop string that never came.
    pub(crate) fn finish(
        mut self,
        finish: Finish,
        on_piece: &mut dyn FnMut(Piece) -> bool,
    ) -> Result<Generated> {
        let rest = self.watch.finish();
        if !rest.is_empty()
            && !on_piece(Piece {
                text: rest,
                logprobs: Vec::new(),
            })
        {
            return Err(ServeError::Abandoned);
        }
        Ok(Generated {
            text: self.watch.plain().to_string(),
            after_marker: self.watch.after_marker().map(str::to_string),
            finish,
            tokens: self.tokens,
            logprobs: self.logprobs,
        })
    }
}

impl LoadedModel {
    /// Generates an answer to `request` on this thread, alone, handing each released
    /// piece to `on_piece`; when it returns false (the client left), generation stops
    /// with [`ServeError::Abandoned`]. Blocking: run it off the async threads.
    pub fn generate_alone(
        &self,
        request: &GenerationRequest,
        on_piece: &mut dyn FnMut(Piece) -> bool,
    ) -> Result<Generated> {
        let mut decoding = Decoding::start(self, request.clone())?;
        let mut cache = self.model.new_cache();
        let mut logits = self.model.forward_cached(decoding.prompt(), &mut cache)?;
        loop {
            match decoding.step(self, &logits, cache.len(), on_piece)? {
                Next::Feed(token) => logits = self.model.forward_cached(&[token], &mut cache)?,
                Next::Done(finish) => return decoding.finish(finish, on_piece),
            }
        }
    }

    /// `id`'s log-probability and the `k` most likely tokens at its position.
    fn token_logprob(&self, id: u32, logprobs: &[f32], k: usize) -> Result<TokenLogprob> {
        let text = |id: u32| -> Result<String> {
            Ok(self
                .encoder
                .tokenizer()
                .decode(&[id], false)
                .map_err(|e| tuneq_dataset::DataError::Tokenizer(e.to_string()))?)
        };
        let top = top_k(logprobs, k)
            .into_iter()
            .map(|(id, lp)| Ok((text(id)?, lp)))
            .collect::<Result<Vec<_>>>()?;
        Ok(TokenLogprob {
            token: text(id)?,
            logprob: logprobs[id as usize],
            top,
        })
    }
}
