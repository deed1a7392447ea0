//! Base models registered from the command line (`--model ID=LOCATION`).

use super::pair::pair;
use crate::cli::BadInput;
use anyhow::{Context, Result};

/// A base model to register: `--model ID=LOCATION`.
pub struct ModelArg {
    /// The id jobs name it by.
    pub id: String,
    /// Where its files are (an absolute folder or a store URI).
    pub location: String,
}

/// The learning rate a `--model` is registered with (LoRA's usual 2e-4); a job's
/// `learning_rate_multiplier` scales it.
pub const BASE_LEARNING_RATE: f64 = 2e-4;

/// Reads `--model ID=LOCATION`: the id is checked, a local folder must hold a model
/// (`config.json`) and is made absolute.
pub fn model_arg(text: &str) -> Result<ModelArg> {
    let (id, location) = pair(text, "--model")?;
    tuneq_queue::catalog::check_identifier("model", &id)
        .map_err(|e| BadInput(format!("--model {text}: {e}")))?;
    let location = match tuneq_storage::Location::parse(&location) {
        Ok(tuneq_storage::Location::Local(path)) => {
            if !path.join("config.json").is_file() {
                return Err(BadInput(format!(
                    "--model {text}: {} has no config.json (a Hugging Face model folder is expected)",
                    path.display()
                ))
                .into());
            }
            // A model of another architecture would be trained as Llama, wrongly and
            // silently: refused now, naming it (remote folders are checked by the
            // trainer when it loads them).
            match tuneq_pools::ModelShape::read(&path) {
                Some(Ok(_)) => {}
                Some(Err(refusal)) => {
                    return Err(BadInput(format!("--model {text}: {refusal}")).into());
                }
                None => {
                    return Err(BadInput(format!(
                        "--model {text}: {} holds no readable config.json of at most 1 MiB",
                        path.display()
                    ))
                    .into());
                }
            }
            std::fs::canonicalize(&path)
                .with_context(|| format!("--model {text}"))?
                .display()
                .to_string()
        }
        Ok(_) => location,
        Err(e) => return Err(BadInput(format!("--model {text}: {e}")).into()),
    };
    Ok(ModelArg { id, location })
}

/// Refuses `--model-alias`es that name no registered base model, or that are base
/// models' own ids (which they would hide).
pub async fn check_aliases(state: &tuneq_api::AppState) -> Result<()> {
    let registered = |id: String| async move {
        tuneq_api::records::model::get(&state.queue, &id)
            .await
            .map(|m| m.is_some())
            .map_err(|e| anyhow::anyhow!("{}", e.detail.message))
    };
    for (alias, base) in &state.config.model_aliases {
        if !registered(base.clone()).await? {
            return Err(BadInput(format!(
                "--model-alias {alias}={base}: no base model `{base}` is registered (add it with --model {base}=PATH)"
            ))
            .into());
        }
        if registered(alias.clone()).await? {
            return Err(BadInput(format!(
                "--model-alias {alias}={base}: `{alias}` is a base model already; an alias may not hide it"
            ))
            .into());
        }
    }
    Ok(())
}

/// Registers a model whose learning rate at multiplier 1 is `base_learning_rate`.
pub async fn register_model(
    state: &tuneq_api::AppState,
    model: ModelArg,
    base_learning_rate: f64,
) -> Result<()> {
    // What `POST /admin/models` records of a local folder (its weights hashed only
    // where a file changed since the last start); a folder it would refuse is registered
    // all the same (its jobs then fail as the trainer finds it), and said.
    let earlier = tuneq_api::records::model::get(&state.queue, &model.id)
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.detail.message))?
        .filter(|earlier| earlier.location == model.location);
    // What `POST /admin/models` gave it (its template, its display name) stays.
    let chat_template = earlier.as_ref().and_then(|m| m.chat_template);
    let display_name = earlier.as_ref().and_then(|m| m.display_name.clone());
    let template = chat_template.unwrap_or_default();
    let storage = &state.config.model_storage;
    let inspection =
        tuneq_api::registry::inspection(&model.location, template, earlier.as_ref(), storage);
    let (details, identity) = match inspection.await {
        Ok(found) => (Some(found.details), found.identity),
        Err(e) => {
            tracing::warn!(model = %model.id, problem = %e.detail.message, "--model: the folder would not pass registration's checks");
            (None, None)
        }
    };
    tuneq_api::records::model::register(
        &state.queue,
        &tuneq_api::records::model::BaseModel {
            display_name,
            details,
            identity,
            chat_template,
            ..tuneq_api::records::model::BaseModel::new(
                &model.id,
                &model.location,
                base_learning_rate,
            )
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{}", e.detail.message))
}
