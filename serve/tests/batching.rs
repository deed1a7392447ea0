//! The decode loop that steps concurrent answers together gives each answer what it
//! would get alone, and lets a caller who stops listening leave without disturbing the
//! others.

use std::sync::Arc;
use tuneq_serve::{Engine, EngineConfig, GenerationRequest, ModelKey, Sampling, ServeError};

fn engine_and_model() -> (tempfile::TempDir, Engine, Arc<tuneq_serve::ServedModel>) {
    let dir = tempfile::tempdir().expect("tempdir");
    tuneq_trainer::init::write_model(&tuneq_trainer::init::InitOptions::demo(), dir.path())
        .expect("model");
    let engine = Engine::new(EngineConfig {
        max_concurrent: 8,
        max_per_tenant: 8,
        resident_models: 1,
        max_batch: 8,
        max_answer_tokens: 64,
    });
    let model = engine
        .model(&ModelKey {
            base: dir.path().to_path_buf(),
            adapter: None,
            template: Default::default(),
        })
        .expect("load");
    (dir, engine, model)
}

fn request(model: &tuneq_serve::LoadedModel, text: &str, sampling: Sampling) -> GenerationRequest {
    let message = tuneq_dataset::Message::new(tuneq_dataset::Role::User, text);
    GenerationRequest {
        prompt: model
            .chat_prompt(&[message], &[], &Default::default(), "")
            .expect("prompt"),
        max_new_tokens: 24,
        sampling,
        seed: 5,
        stop: Vec::new(),
        markers: Vec::new(),
        logprobs: Some(1),
        format: None,
    }
}

/// An answer's tokens, each as its text.
fn tokens(g: &tuneq_serve::Generated) -> Vec<String> {
    g.logprobs.iter().map(|l| l.token.clone()).collect()
}

#[test]
fn answers_decoded_together_equal_answers_decoded_alone() {
    let (_dir, _engine, model) = engine_and_model();
    let texts = [
        "Hello there",
        "A much longer question about rivers and seas",
        "x",
        "Why?",
    ];
    for sampling in [Sampling::greedy(), Sampling::default()] {
        let requests: Vec<_> = texts
            .iter()
            .map(|t| request(&model, t, sampling.clone()))
            .collect();
        let alone: Vec<_> = requests
            .iter()
            .map(|r| model.generate_alone(r, &mut |_| true).expect("alone"))
            .collect();
        let together: Vec<_> = requests
            .iter()
            .cloned()
            .map(|r| {
                let model = model.clone();
                std::thread::spawn(move || model.generate(&r, &mut |_| true))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().expect("thread").expect("together"))
            .collect();
        assert!(
            model.widest_step() >= 2,
            "the answers were never stepped together"
        );
        for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(tokens(a), tokens(t), "answer {i} ({sampling:?})");
            assert_eq!((a.tokens, a.finish), (t.tokens, t.finish), "answer {i}");
        }
    }
}

#[test]
fn a_caller_who_stops_listening_leaves_and_the_others_finish() {
    let (_dir, _engine, model) = engine_and_model();
    let long = request(&model, "Hello there", Sampling::greedy());
    let leaver = {
        let (model, request) = (model.clone(), long.clone());
        std::thread::spawn(move || {
            let mut pieces = 0;
            model.generate(&request, &mut |_| {
                pieces += 1;
                pieces < 3
            })
        })
    };
    let stayer = {
        let (model, request) = (model.clone(), long.clone());
        std::thread::spawn(move || model.generate(&request, &mut |_| true))
    };
    assert!(matches!(
        leaver.join().expect("thread"),
        Err(ServeError::Abandoned)
    ));
    let done = stayer.join().expect("thread").expect("the other answer");
    assert_eq!(done.tokens, long.max_new_tokens.min(done.tokens));
    assert!(done.tokens > 3);
}

#[test]
fn a_long_prompt_fills_in_chunks_beside_an_answer_in_flight_and_changes_no_answer() {
    let (_dir, engine, model) = engine_and_model();
    let mut decoding = request(&model, "Hello there", Sampling::greedy());
    decoding.max_new_tokens = 64;
    // Several passes' worth of prompt while an answer is being decoded.
    let long_text = "rivers and seas and mountains ".repeat(90);
    let long = request(&model, &long_text, Sampling::greedy());
    assert!(long.prompt.len() > 600, "{} tokens", long.prompt.len());
    let alone = [&decoding, &long].map(|r| model.generate_alone(r, &mut |_| true).expect("alone"));

    let (started, is_decoding) = std::sync::mpsc::channel();
    let first = {
        let (model, request) = (model.clone(), decoding.clone());
        std::thread::spawn(move || {
            model.generate(&request, &mut |_| {
                let _ = started.send(());
                true
            })
        })
    };
    is_decoding.recv().expect("the first answer's first piece");
    let second = {
        let (model, request) = (model.clone(), long.clone());
        std::thread::spawn(move || model.generate(&request, &mut |_| true))
    };
    let together = [first, second].map(|h| h.join().expect("thread").expect("answer"));
    assert!(
        model.chunked_passes() >= 2,
        "the long prompt was not filled in chunks ({} passes left it partly filled)",
        model.chunked_passes()
    );
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(tokens(a), tokens(t), "answer {i}");
    }
    // The engine's totals (`/metrics`) count the same passes: every one that left the
    // prompt partly filled, and two answers in some of them.
    let totals = engine.decode_totals();
    assert_eq!(totals.chunked(), model.chunked_passes() as u64);
    assert!(
        totals.rows() > totals.passes() && totals.passes() > totals.chunked(),
        "passes {}, rows {}, chunked {}",
        totals.passes(),
        totals.rows(),
        totals.chunked()
    );
}
