//! Guessing keys (the second probe's M1): a source past its failures is refused before
//! any key is looked up, so the answer says nothing of the key; concurrent guesses cannot
//! share an allowance; and guesses at keys that start alike are bounded wherever they
//! come from.

#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::{ADMIN_KEY, get, start};

/// A client calling from `ip` (a loopback address of its own, so that the sources of
/// one test stay apart).
fn client_from(ip: [u8; 4]) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(std::net::IpAddr::from(ip))
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_source_past_its_failures_is_refused_whatever_key_it_sends() {
    let s = start(|_| {}).await;
    let guesser = client_from([127, 0, 0, 77]);
    let response = guesser
        .post(format!("{}/admin/tenants", s.url))
        .bearer_auth(&s.acme)
        .json(&json!({"id": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    // Thirty failures (the one above among them) are answered as they are.
    for i in 1..30 {
        let response = get(
            &guesser,
            format!("{}/v1/models", s.url),
            format!("tq_wrong_key_number_{i:04}"),
        )
        .await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    }
    // Then the source is refused before any key is looked up: a wrong key and the right
    // ones alike, so the answer tells a guesser nothing.
    for key in ["tq_wrong_key_number_9999", &s.acme, ADMIN_KEY] {
        let path = if key == ADMIN_KEY {
            "/admin/tenants/acme/keys"
        } else {
            "/v1/models"
        };
        let response = get(&guesser, format!("{}{path}", s.url), key).await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS, "{path}");
        assert!(response.headers().contains_key("retry-after"));
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "too_many_failed_authentications");
    }
    // Another source is not affected.
    let other = client_from([127, 0, 0, 78]);
    let response = get(&other, format!("{}/v1/models", s.url), &s.acme).await;
    assert_eq!(response.status(), StatusCode::OK);
    let response = get(
        &other,
        format!("{}/admin/tenants/acme/keys", s.url),
        ADMIN_KEY,
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn concurrent_guesses_cannot_share_a_failure_allowance() {
    let s = start(|_| {}).await;
    let guesser = client_from([127, 0, 0, 79]);
    // 60 guesses at once, the admin key among them (the probe's 40-connection attack):
    // at most the allowance of 30 is answered as a key check, the rest are refused.
    let mut keys: Vec<String> = (0..60)
        .map(|i| format!("tq_parallel_guess_{i:04}"))
        .collect();
    keys[45] = ADMIN_KEY.to_string();
    let guesses = keys.iter().map(|key| {
        guesser
            .get(format!("{}/admin/tenants/acme/keys", s.url))
            .bearer_auth(key)
            .send()
    });
    let statuses: Vec<StatusCode> = futures::future::join_all(guesses)
        .await
        .into_iter()
        .map(|r| r.unwrap().status())
        .collect();
    // Wrong keys answered as such: at most the allowance. (A right key among the first
    // 30 gives its credit back, so one more may be checked; it is found within the 30
    // tries the allowance grants anyway.)
    let wrong = statuses
        .iter()
        .filter(|s| **s == StatusCode::UNAUTHORIZED)
        .count();
    assert!(wrong <= 30, "{wrong} of 60 were answered 401: {statuses:?}");
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert!(refused >= 29, "{statuses:?}");
}

#[tokio::test]
async fn guesses_at_one_key_prefix_are_bounded_across_sources() {
    let s = start(|_| {}).await;
    // Someone who knows the start of a key tries endings from 60 addresses, one each.
    let known = &s.acme[..16];
    let mut checked = 0;
    for i in 0..60u8 {
        let guesser = client_from([127, 0, 1, i + 1]);
        let response = get(
            &guesser,
            format!("{}/v1/models", s.url),
            format!("{known}{i:024}"),
        )
        .await;
        if response.status() != StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
            checked += 1;
        }
    }
    assert!(
        checked <= 30,
        "{checked} of 60 guesses at one prefix were checked"
    );
    // Keys that start otherwise, and the other tenant, are not affected.
    let other = client_from([127, 0, 2, 1]);
    let response = get(&other, format!("{}/v1/models", s.url), &s.other).await;
    assert_eq!(response.status(), StatusCode::OK);
}
