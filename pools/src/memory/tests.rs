use super::*;

pub(crate) fn small() -> ModelShape {
    serde_json::from_value(serde_json::json!({
        "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 512
    }))
    .unwrap()
}

fn ask(lora: &LoraSpec, batch_size: u64, dtype: DtypeKind) -> Ask<'_> {
    Ask {
        lora,
        max_seq_len: 512,
        batch_size,
        dtype,
        compute: ComputeKind::F32,
        checkpointing: ActivationCheckpointing::Auto,
        dataset_tokens: 0,
    }
}

fn llama2_7b() -> ModelShape {
    serde_json::from_value(serde_json::json!({
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096
    }))
    .unwrap()
}

/// A fresh model folder named after `tag` holding a two-layer `config.json` with
/// `vocab_size` entries; the folder and the config's text.
fn model_folder(tag: &str, vocab_size: u64) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("tuneq-pools-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": vocab_size
    })
    .to_string();
    std::fs::write(dir.join("config.json"), &config).unwrap();
    (dir, config)
}

#[test]
fn a_tokenizer_of_added_tokens_is_counted_heavier_than_one_of_merges() {
    let (dir, _) = model_folder("shape", 32000);
    // No tokenizer file: every entry counts as added, the larger figure.
    let unknown = ModelShape::read(&dir).unwrap().unwrap();
    assert_eq!(unknown.added_tokens, None);
    let tokenizer = serde_json::json!({
        "added_tokens": [{"id": 0, "content": "<s>"}, {"id": 1, "content": "</s>"}],
        "model": {"type": "BPE", "vocab": {"a": 2}, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let merges = ModelShape::read(&dir).unwrap().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(merges.added_tokens, Some(2));
    let mostly_added = ModelShape {
        added_tokens: Some(29_000),
        ..merges.clone()
    };
    let (few, many, all) = (
        tokenizer_bytes(&merges),
        tokenizer_bytes(&mostly_added),
        tokenizer_bytes(&unknown),
    );
    assert!(few < many && many < all, "{few} {many} {all}");
    // 32000 entries of a BPE without merges: about 4 + 12 MiB; with one merge each
    // (most real BPEs), 23 MiB more; with two (Gemma's), 45 more.
    assert_eq!(few >> 20, 15);
    assert_eq!(merges.merges, Some(0));
    let with_merges = |count| {
        let shape = ModelShape {
            merges: Some(count),
            ..merges.clone()
        };
        tokenizer_bytes(&shape) >> 20
    };
    assert_eq!((with_merges(32_000), with_merges(64_000)), (38, 60));
}

#[test]
fn a_folder_of_another_architecture_is_refused_not_read_as_llama() {
    let (dir, _) = model_folder("phi", 256);
    let phi = serde_json::json!({
        "model_type": "phi", "architectures": ["PhiForCausalLM"], "hidden_size": 64,
        "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 256
    });
    std::fs::write(dir.join("config.json"), phi.to_string()).unwrap();
    let read = ModelShape::read(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    let refusal = read.expect("a readable config").unwrap_err();
    assert_eq!(refusal.field(), "model_type");
    assert!(refusal.to_string().contains("\"phi\""), "{refusal}");
}

#[test]
fn a_gemma_on_the_cpu_is_estimated_on_the_fused_step_with_its_output_norms() {
    let llama = ModelShape {
        hidden_size: 640,
        intermediate_size: 2048,
        num_hidden_layers: 18,
        num_attention_heads: 4,
        num_key_value_heads: Some(1),
        head_dim: Some(256),
        vocab_size: 262_144,
        max_position_embeddings: Some(32768),
        tie_word_embeddings: true,
        torch_dtype: Some("float32".into()),
        sliding_window: None,
        model_type: Some("llama".into()),
        added_tokens: Some(0),
        merges: Some(0),
    };
    let gemma = ModelShape {
        sliding_window: Some(512),
        model_type: Some("gemma2".into()),
        ..llama.clone()
    };
    let lora = LoraSpec::default();
    let ask = Ask {
        lora: &lora,
        max_seq_len: 512,
        batch_size: 4,
        dtype: DtypeKind::F32,
        compute: ComputeKind::F32,
        checkpointing: ActivationCheckpointing::Off,
        dataset_tokens: 0,
    };
    assert_eq!(
        cpu_memory_needed(&llama, &ask),
        cpu_memory(&llama, &ask, Some(0)).total()
    );
    assert_eq!(
        cpu_memory_needed(&gemma, &ask),
        cpu_memory(&gemma, &ask, Some(0)).total()
    );
    // A Gemma 2's fused step keeps each half's output before its norm, and its 1/rms:
    // 2·(hidden + 1) floats per token and layer more than a Llama's of the same shape.
    let step = |shape: &ModelShape| cpu_memory(shape, &ask, Some(0)).step;
    let tokens = 4 * 512;
    assert_eq!(step(&gemma) - step(&llama), 4 * 2 * (640 + 1) * tokens * 18);
    // On a GPU (candle's graph) its layers keep more too.
    assert!(graph_memory_bytes(&gemma, &ask, true) > graph_memory_bytes(&llama, &ask, true));
}

#[test]
fn a_config_file_over_its_limit_is_not_read() {
    let (dir, config) = model_folder("big", 256);
    // JSON allows trailing whitespace: the same config, `len` bytes long.
    let padded = |len: u64| {
        let mut text = config.clone();
        text.push_str(&" ".repeat(len as usize - config.len()));
        text
    };
    std::fs::write(dir.join("config.json"), padded(CONFIG_FILE_LIMIT)).unwrap();
    let at_limit = ModelShape::read(&dir);
    std::fs::write(dir.join("config.json"), padded(CONFIG_FILE_LIMIT + 1)).unwrap();
    let over = ModelShape::read(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        matches!(at_limit, Some(Ok(_))),
        "a config of exactly the limit is read"
    );
    assert!(over.is_none(), "a config one byte over the limit is not");
}

#[test]
fn memory_grows_with_the_batch_and_halves_its_weights_in_bf16() {
    let shape = small();
    let lora = LoraSpec::default();
    let one = cpu_memory(&shape, &ask(&lora, 1, DtypeKind::F32), None);
    let eight = cpu_memory(&shape, &ask(&lora, 8, DtypeKind::F32), None);
    assert!(eight.step > one.step * 7, "{one:?} {eight:?}");
    let bf16 = cpu_memory(&shape, &ask(&lora, 1, DtypeKind::Bf16), None);
    assert_eq!(one.weights - bf16.weights, shape.parameters() * 2);
    let gpu = |dtype| gpu_memory_bytes(&shape, &ask(&lora, 1, dtype));
    // Weights and activations both halve on a GPU.
    assert!(gpu(DtypeKind::F32) - gpu(DtypeKind::Bf16) > shape.parameters() * 2);
}

#[test]
fn auto_is_f32_on_the_cpu_and_bf16_on_a_gpu() {
    let shape = small();
    let lora = LoraSpec::default();
    let cpu = |dtype| cpu_memory(&shape, &ask(&lora, 2, dtype), None);
    let gpu = |dtype| gpu_memory_bytes(&shape, &ask(&lora, 2, dtype));
    assert_eq!(cpu(DtypeKind::Auto), cpu(DtypeKind::F32));
    assert_eq!(gpu(DtypeKind::Auto), gpu(DtypeKind::Bf16));
    assert_ne!(gpu(DtypeKind::Auto), gpu(DtypeKind::F32));
}

/// bf16 compute holds `auto` weights in bf16 on the CPU too, and its step holds the
/// rounded operand (512 tokens × the widest projection side, 172, as f32).
#[test]
fn bf16_compute_holds_bf16_weights_and_a_rounded_operand() {
    let shape = small();
    let lora = LoraSpec::default();
    let bf16 = cpu_memory(&shape, &ask(&lora, 1, DtypeKind::Bf16), None);
    let computing = |dtype| {
        cpu_memory(
            &shape,
            &Ask {
                compute: ComputeKind::Bf16,
                ..ask(&lora, 1, dtype)
            },
            None,
        )
    };
    assert_eq!(computing(DtypeKind::Auto), computing(DtypeKind::Bf16));
    let with = computing(DtypeKind::Auto);
    assert_eq!(with.weights, bf16.weights);
    let rounded = 4 * 512 * 172; // f32: oneMKL builds hold it as bf16, half that
    assert_eq!(with.step - bf16.step, rounded);
}

#[test]
fn tied_embeddings_are_counted_once() {
    let mut shape = small();
    let untied = shape.parameters();
    shape.tie_word_embeddings = true;
    assert_eq!(untied - shape.parameters(), 256 * 64);
}

#[test]
fn auto_checkpointing_on_the_graph_follows_the_accelerator_memory() {
    let shape = llama2_7b();
    let lora = LoraSpec::default();
    let a = ask(&lora, 1, DtypeKind::Bf16);
    assert_eq!(a.checkpointing, ActivationCheckpointing::Auto);
    let with = |checkpointing| Ask {
        checkpointing,
        ..a.clone()
    };
    let keep = gpu_memory_bytes(&shape, &with(ActivationCheckpointing::Off));
    let recompute = gpu_memory_bytes(&shape, &with(ActivationCheckpointing::On));
    assert!(recompute < keep, "{recompute} < {keep}");
    // `auto` recomputes exactly when keeping would not fit, and never without a limit.
    assert!(!graph_checkpointing(&shape, &a, true, None));
    assert!(!graph_checkpointing(&shape, &a, true, Some(keep)));
    assert!(graph_checkpointing(&shape, &a, true, Some(keep - 1)));
    // `on` and `off` are what they say, whatever the limit.
    let off = with(ActivationCheckpointing::Off);
    assert!(!graph_checkpointing(&shape, &off, true, Some(0)));
    let on = with(ActivationCheckpointing::On);
    assert!(graph_checkpointing(&shape, &on, true, None));
    // Placement counts `auto` at its least, like `on`; `off` at its most.
    assert_eq!(gpu_memory_needed(&shape, &a), recompute);
    assert_eq!(gpu_memory_needed(&shape, &off), keep);
}

#[test]
fn auto_checkpointing_recomputes_only_when_the_limit_asks_for_it() {
    let shape = llama2_7b();
    let lora = LoraSpec::default();
    let a = ask(&lora, 4, DtypeKind::Bf16);
    let roomy = cpu_memory(&shape, &a, Some(1 << 40));
    assert!(!roomy.checkpointing);
    let tight = cpu_memory(&shape, &a, Some(roomy.total() - 1));
    assert!(
        tight.checkpointing && tight.total() < roomy.total(),
        "{tight:?}"
    );
    let never = cpu_memory(
        &shape,
        &Ask {
            checkpointing: ActivationCheckpointing::Off,
            ..a.clone()
        },
        Some(roomy.total() - 1),
    );
    assert_eq!(never, roomy);
    let always = cpu_memory(
        &shape,
        &Ask {
            checkpointing: ActivationCheckpointing::On,
            ..a
        },
        None,
    );
    assert_eq!(always, tight);
}

#[test]
fn a_7b_llama_in_bf16_with_checkpointing_fits_a_32_gib_xeon_node() {
    let shape = llama2_7b();
    let params = shape.parameters();
    assert!((6_500_000_000..7_000_000_000).contains(&params), "{params}");
    let lora = LoraSpec::default();
    let mut a = ask(&lora, 4, DtypeKind::Bf16);
    a.max_seq_len = 2048;
    a.checkpointing = ActivationCheckpointing::On;
    let m = cpu_memory(&shape, &a, None);
    assert!(m.weights > params * 2 - 1 && m.total() < 32 << 30, "{m:?}");
    a.dtype = DtypeKind::F32;
    assert!(cpu_memory(&shape, &a, None).total() > 32 << 30);
}

fn llama32_1b() -> ModelShape {
    serde_json::from_value(serde_json::json!({
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 131072,
        "tie_word_embeddings": true
    }))
    .unwrap()
}

/// The table in README "What fits where": each row's claim, checked, and printed
/// (`cargo test -p tuneq-pools fit_table -- --nocapture`).
#[test]
fn fit_table() {
    const GIB: u64 = 1 << 30;
    let lora = LoraSpec::default();
    let (on, off) = (ActivationCheckpointing::On, ActivationCheckpointing::Off);
    let (f32, bf16) = (DtypeKind::F32, DtypeKind::Bf16);
    let rows = [
        ("Llama 2 7B", llama2_7b(), bf16, 2048, on, 32, true),
        ("Llama 2 7B", llama2_7b(), bf16, 2048, off, 32, false),
        ("Llama 2 7B", llama2_7b(), f32, 2048, on, 32, false),
        ("Llama 2 7B", llama2_7b(), bf16, 512, off, 32, true),
        ("Llama 2 7B", llama2_7b(), f32, 512, on, 32, true),
        ("Llama 3.2 1B", llama32_1b(), bf16, 512, on, 8, true),
        ("Llama 3.2 1B", llama32_1b(), f32, 512, off, 8, false),
        ("Llama 3.2 1B", llama32_1b(), f32, 2048, on, 16, true),
    ];
    for (name, shape, dtype, seq, checkpointing, node_gib, fits) in rows {
        let ask = Ask {
            lora: &lora,
            max_seq_len: seq,
            batch_size: 4,
            dtype,
            compute: ComputeKind::F32,
            checkpointing,
            dataset_tokens: 10_000_000,
        };
        let m = cpu_memory(&shape, &ask, None);
        eprintln!(
            "| {name} | {dtype:?} | 4 × {seq} | {checkpointing:?} | {:.1} GiB (weights {:.1}, step {:.1}) | {node_gib} GiB | {} |",
            m.total() as f64 / GIB as f64,
            m.weights as f64 / GIB as f64,
            m.step as f64 / GIB as f64,
            if fits { "fits" } else { "does not fit" }
        );
        assert_eq!(
            m.total() <= node_gib * GIB,
            fits,
            "{name} {dtype:?} {seq} {checkpointing:?} {m:?}"
        );
    }
    // On an L4 (24 GB), candle's graph: bf16 weights and activations, the loss in f32.
    let l4 = 24_000_000_000;
    let gpu_rows = [
        (1, 512, off, false),
        (1, 512, on, true),
        (4, 512, on, true),
        (1, 2048, on, true),
        (4, 2048, on, false),
        // `auto` (the API's default): the trainer turns recomputation on.
        (1, 512, ActivationCheckpointing::Auto, true),
    ];
    for (batch_size, seq, checkpointing, fits) in gpu_rows {
        let ask = Ask {
            lora: &lora,
            max_seq_len: seq,
            batch_size,
            dtype: bf16,
            compute: ComputeKind::F32,
            checkpointing,
            dataset_tokens: 0,
        };
        let bytes = gpu_memory_needed(&llama2_7b(), &ask);
        eprintln!(
            "| Llama 2 7B | bf16 | {batch_size} × {seq} | {checkpointing:?} | {:.1} GiB | L4 24 GB | {} |",
            bytes as f64 / GIB as f64,
            if fits { "fits" } else { "does not fit" }
        );
        assert_eq!(bytes <= l4, fits, "{batch_size} × {seq} {checkpointing:?}");
    }
}
