//! `tuneq models add|remove|list`: the model registry of a running service
//! (`POST /admin/models`, `DELETE /admin/models/{id}`, with the admin key), and the
//! models a tenant can use (`GET /v1/models`, with its API key).

use super::BadInput;
use anyhow::{Context, Result};
use std::process::ExitCode;

/// The registry commands.
#[derive(clap::Subcommand)]
pub enum ModelsCommand {
    /// Register a base model every tenant may fine-tune: a Hugging Face folder on the
    /// service's machines (checked first: architecture, tokenizer, every weight's
    /// shape; every problem named) or an `s3://` / `gs://` URI. Prints the model as
    /// JSON, with what the check found (`details`).
    Add {
        /// The name jobs fine-tune it by.
        id: String,
        /// Its folder (an absolute path on the service's machines) or store URI.
        location: String,
        /// Peak learning rate at `learning_rate_multiplier` 1 (the service's default
        /// when not given).
        #[arg(long)]
        base_learning_rate: Option<f64>,
        /// A name to show beside the id in the model list.
        #[arg(long)]
        display_name: Option<String>,
        /// The chat template its jobs train with and its fine-tuned models answer with:
        /// `model` (the folder's own; the default) or a built-in (`chatml`, `llama2`,
        /// `alpaca`).
        #[arg(long, value_parser = ["model", "chatml", "llama2", "alpaca"])]
        chat_template: Option<String>,
        #[command(flatten)]
        service: Service,
    },
    /// List the models a tenant can use — base models with what registration found
    /// (architecture, parameters, context, dtype, template, the pools that fit a
    /// fine-tune), aliases and the tenant's fine-tuned models — as a table, or as the
    /// service's JSON.
    List {
        /// The service's URL.
        #[arg(long, env = "TUNEQ_URL", default_value = "http://127.0.0.1:8080")]
        url: String,
        /// The tenant's API key (`tuneq up` prints it, and keeps it in
        /// `<data-dir>/api-key`).
        #[arg(long, env = "TUNEQ_API_KEY", hide_env_values = true)]
        api_key: String,
        /// Print the service's answer as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Remove a base model from the registry (refused while an unfinished job trains on
    /// it); its files are not touched.
    Remove {
        /// The model's id.
        id: String,
        #[command(flatten)]
        service: Service,
    },
}

/// Which service, and the key its admin routes take.
#[derive(clap::Args)]
pub struct Service {
    /// The service's URL.
    #[arg(long, env = "TUNEQ_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The service's admin key (`--admin-key` of `tuneq up` / `tuneq api`).
    #[arg(long, env = "TUNEQ_ADMIN_KEY", hide_env_values = true)]
    admin_key: String,
}

/// Runs a registry command: the answer on stdout; a refusal (4xx) exits 2 with its
/// message on stderr.
pub fn run(command: ModelsCommand) -> Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let http = reqwest::Client::new();
        let request = match command {
            ModelsCommand::Add {
                id,
                location,
                base_learning_rate,
                display_name,
                chat_template,
                service,
            } => {
                let mut body = serde_json::json!({"id": id, "location": location});
                if let Some(rate) = base_learning_rate {
                    body["base_learning_rate"] = rate.into();
                }
                if let Some(name) = display_name {
                    body["display_name"] = name.into();
                }
                if let Some(template) = chat_template {
                    body["chat_template"] = template.into();
                }
                http.post(endpoint(&service, "/admin/models")?)
                    .bearer_auth(&service.admin_key)
                    .json(&body)
            }
            ModelsCommand::Remove { id, service } => {
                let mut url = endpoint(&service, "/admin/models")?;
                url.path_segments_mut()
                    .map_err(|()| BadInput(format!("--url {} is not a base URL", service.url)))?
                    .push(&id);
                http.delete(url).bearer_auth(&service.admin_key)
            }
            ModelsCommand::List { url, api_key, json } => {
                let base =
                    reqwest::Url::parse(&url).map_err(|e| BadInput(format!("--url {url}: {e}")))?;
                let listed =
                    answer(http.get(base.join("/v1/models")?).bearer_auth(api_key)).await?;
                match json {
                    true => println!("{}", serde_json::to_string_pretty(&listed)?),
                    false => print!("{}", table(&serde_json::from_value(listed)?)),
                }
                return Ok(ExitCode::SUCCESS);
            }
        };
        let body = answer(request).await?;
        println!("{}", serde_json::to_string_pretty(&body)?);
        Ok(ExitCode::SUCCESS)
    })
}

/// The service's JSON answer to `request`; a refusal (4xx) as bad input with its
/// message.
async fn answer(request: reqwest::RequestBuilder) -> Result<serde_json::Value> {
    let response = request.send().await.context("the service did not answer")?;
    let status = response.status();
    let body: serde_json::Value = response
        .json()
        .await
        .with_context(|| format!("the service answered {status} without a JSON body"))?;
    if status.is_client_error() {
        let message = body["error"]["message"].as_str().unwrap_or("refused");
        return Err(BadInput(format!("{status}: {message}")).into());
    }
    anyhow::ensure!(status.is_success(), "the service answered {status}: {body}");
    Ok(body)
}

/// The model list as a table, a model a line: its id, what it is, and for a base
/// model what registration found.
fn table(list: &tuneq_openapi::ModelList) -> String {
    let mut rows = vec![
        [
            "ID",
            "KIND",
            "ARCHITECTURE",
            "PARAMETERS",
            "CONTEXT",
            "DTYPE",
            "TEMPLATE",
            "FITS POOLS",
        ]
        .map(String::from),
    ];
    for model in &list.data {
        let kind = match &model.base_model {
            Some(base) => format!("{} of {base}", model.kind),
            None => model.kind.clone(),
        };
        let mut row = [
            model.id.clone(),
            kind,
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
        ];
        if let Some(d) = &model.details {
            let source = match d.chat_template {
                tuneq_openapi::ChatTemplateSource::Own => "own",
                tuneq_openapi::ChatTemplateSource::BuiltIn => "built-in",
            };
            let template = serde_json::to_value(d.template).ok();
            let template = template
                .as_ref()
                .and_then(|t| t.as_str())
                .unwrap_or("model");
            row[2] = d.architecture.clone();
            row[3] = format!("{:.1}M", d.parameters as f64 / 1e6);
            row[4] = d.context_length.to_string();
            row[5] = d.dtype.clone();
            row[6] = format!("{template} ({source})");
            row[7] = match d.fits_pools.is_empty() {
                true => "none".into(),
                false => d.fits_pools.join(","),
            };
        }
        rows.push(row);
    }
    let widths: Vec<usize> = (0..8)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// `path` on the service.
fn endpoint(service: &Service, path: &str) -> Result<reqwest::Url> {
    let base = reqwest::Url::parse(&service.url)
        .map_err(|e| BadInput(format!("--url {}: {e}", service.url)))?;
    Ok(base.join(path)?)
}
