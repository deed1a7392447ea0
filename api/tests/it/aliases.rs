//! Model aliases: an OpenAI model name the operator maps to a registered base model is
//! fine-tuned as that model, shows as `model` on the job with the real one as
//! `base_model`, names the fine-tuned model, and is listed and retrieved as a model.

use crate::support::{self, create, examples, get_json, upload};
use serde_json::json;

const ALIAS: &str = "gpt-4o-mini-2024-07-18";

#[tokio::test]
async fn an_alias_is_fine_tuned_as_its_base_model_and_listed() {
    let s = support::start(|c| {
        c.model_aliases = [(ALIAS.to_string(), "base".to_string())].into();
    })
    .await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    let (status, job) = create(&s, &file, json!({"model": ALIAS, "suffix": "mig"})).await;
    assert_eq!(status, 200, "{job}");
    assert_eq!(
        (job["model"].as_str(), job["base_model"].as_str()),
        (Some(ALIAS), Some("base"))
    );
    let retrieved = get_json(
        &s,
        &format!("/v1/fine_tuning/jobs/{}", job["id"].as_str().unwrap()),
    )
    .await;
    assert_eq!(retrieved["model"], ALIAS);
    assert_eq!(retrieved["base_model"], "base");

    let models = get_json(&s, "/v1/models").await;
    let listed: Vec<(&str, &str)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["kind"].as_str().unwrap()))
        .collect();
    assert!(
        listed.contains(&("base", "base")) && listed.contains(&(ALIAS, "alias")),
        "{listed:?}"
    );
    let alias = get_json(&s, &format!("/v1/models/{ALIAS}")).await;
    assert_eq!(
        (alias["kind"].as_str(), alias["base_model"].as_str()),
        (Some("alias"), Some("base"))
    );

    // A job on the base model's own id shows it as both.
    let (_, plain) = create(&s, &file, json!({})).await;
    assert_eq!(
        (plain["model"].as_str(), plain["base_model"].as_str()),
        (Some("base"), Some("base"))
    );
}

#[tokio::test]
async fn an_unknown_openai_model_name_is_model_not_found() {
    let s = support::start(|_| {}).await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    let (status, body) = create(&s, &file, json!({"model": ALIAS})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(body["error"]["param"], "model");
    let models = get_json(&s, "/v1/models").await;
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["id"] != ALIAS)
    );
}
