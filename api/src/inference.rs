//! What a server that answers chat requests keeps: the engine (resident models,
//! generation slots), where models are staged from, and the tokens each tenant used
//! (for `/metrics`). The handlers are in [`crate::chat`].

use std::collections::BTreeMap;
use std::sync::Mutex;
use tuneq_openapi::Usage;
use tuneq_serve::{Engine, EngineConfig, Staging};

/// Tenants whose token counts are kept apart in `/metrics`; later ones are summed
/// under `other` (tenants are made by the operator, so this is not reached in
/// practice; it bounds the labels whatever happens).
const MAX_USAGE_TENANTS: usize = 1000;

/// What serving answers needs: the engine (resident models, generation slots), where
/// models are staged from, and the tokens each tenant used.
#[derive(Debug)]
pub struct Inference {
    engine: Engine,
    staging: Staging,
    usage: Mutex<BTreeMap<String, Usage>>,
}

impl Inference {
    /// Inference with `engine`'s settings, staging models with `staging`.
    pub fn new(engine: EngineConfig, staging: Staging) -> Self {
        Self {
            engine: Engine::new(engine),
            staging,
            usage: Mutex::new(BTreeMap::new()),
        }
    }

    /// The engine.
    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Where models are staged from.
    pub(crate) fn staging(&self) -> &Staging {
        &self.staging
    }

    /// Adds a request's tokens to its tenant's.
    pub(crate) fn count(&self, tenant: &str, usage: Usage) {
        let Ok(mut all) = self.usage.lock() else {
            return;
        };
        let key = match all.contains_key(tenant) || all.len() < MAX_USAGE_TENANTS {
            true => tenant,
            false => "other",
        };
        let entry = all.entry(key.to_string()).or_default();
        entry.prompt_tokens += usage.prompt_tokens;
        entry.completion_tokens += usage.completion_tokens;
        entry.total_tokens += usage.total_tokens;
    }

    /// Generations running now, and the bound.
    fn slots(&self) -> (usize, usize) {
        (self.engine.busy(), self.engine.config().max_concurrent)
    }

    /// Its `/metrics` series: tokens by tenant and kind, generations running, slots.
    pub(crate) fn render(&self, out: &mut String, label: impl Fn(&str) -> String) {
        use std::fmt::Write;
        let usage = self.usage.lock().map(|u| u.clone()).unwrap_or_default();
        let _ = writeln!(
            out,
            "# HELP tuneq_chat_tokens_total Tokens of chat requests: the prompts read and the answers generated."
        );
        let _ = writeln!(out, "# TYPE tuneq_chat_tokens_total counter");
        for (tenant, used) in &usage {
            let tenant = label(tenant);
            for (kind, n) in [
                ("prompt", used.prompt_tokens),
                ("completion", used.completion_tokens),
            ] {
                let _ = writeln!(
                    out,
                    "tuneq_chat_tokens_total{{tenant=\"{tenant}\",kind=\"{kind}\"}} {n}"
                );
            }
        }
        let (busy, max) = self.slots();
        let _ = writeln!(
            out,
            "# HELP tuneq_generations_running Answers being generated now."
        );
        let _ = writeln!(out, "# TYPE tuneq_generations_running gauge");
        let _ = writeln!(out, "tuneq_generations_running {busy}");
        let _ = writeln!(
            out,
            "# HELP tuneq_generation_slots Answers generated at once at most."
        );
        let _ = writeln!(out, "# TYPE tuneq_generation_slots gauge");
        let _ = writeln!(out, "tuneq_generation_slots {max}");
        let totals = self.engine.decode_totals();
        for (name, help, value) in [
            (
                "tuneq_decode_passes_total",
                "Passes of the decode loops: each steps the answers in flight together.",
                totals.passes(),
            ),
            (
                "tuneq_decode_rows_total",
                "Answers stepped, summed over the passes (over the passes: the mean batch).",
                totals.rows(),
            ),
            (
                "tuneq_decode_chunked_passes_total",
                "Passes that left a long prompt partly filled, to go on beside the answers in flight.",
                totals.chunked(),
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {value}");
        }
    }
}
