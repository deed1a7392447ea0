//! What only a Redis Cluster can get wrong, beyond the conformance suite (which runs on
//! one too): a domain lives whole on the one node that owns its hash tag's slot, domains
//! spread over all the nodes, and the keyspace reads (`KEYS` in [`Queue::keys`] and
//! [`Queue::destroy`]) reach the owning node whichever node the client was given first.

#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::collections::HashSet;
use tuneq_queue::testing;
use tuneq_queue::*;
use tuneq_queue::{JobQueue, Queue};

/// The domain's keys as each node holds them, asked over a plain (non-cluster)
/// connection: a node that does not own the slot has none of them.
async fn keys_per_node(urls: &[String], prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for url in urls {
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut conn)
            .await
            .unwrap();
        keys.sort();
        out.push(keys);
    }
    out
}

#[tokio::test]
async fn each_domain_lives_on_one_node_and_domains_spread_over_all_of_them() {
    let cluster = testing::shared_cluster();
    // Only the first node is given: the client finds the others from it.
    let seed = &cluster.urls[..1];
    let mut owners = HashSet::new();
    for _ in 0..30 {
        let domain = testing::unique_domain("spread");
        let q = Queue::connect_cluster(seed, &domain, QueueConfig::default())
            .await
            .unwrap();
        q.set_pool("gpu", 1).await.unwrap();
        let job = NewJob {
            max_attempts: 1,
            ..support::new_job("t", 1, "{}")
        };
        let id = q.enqueue(&job).await.unwrap().id;
        let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
        assert_eq!(lease.id, id);
        q.complete(&id, lease.token, "{}").await.unwrap();

        let keys = q.keys().await.unwrap();
        assert!(keys.contains(&format!("{}meta", q.prefix())), "{keys:?}");
        let per_node = keys_per_node(&cluster.urls, q.prefix()).await;
        let holders: Vec<usize> = (0..per_node.len())
            .filter(|&n| !per_node[n].is_empty())
            .collect();
        assert_eq!(holders.len(), 1, "domain {domain} is split: {per_node:?}");
        assert_eq!(per_node[holders[0]], keys, "keys() asked the owning node");
        owners.insert(holders[0]);

        q.destroy().await.unwrap();
        assert!(q.keys().await.unwrap().is_empty());
        assert!(
            keys_per_node(&cluster.urls, q.prefix())
                .await
                .iter()
                .all(Vec::is_empty)
        );
    }
    assert_eq!(owners.len(), 3, "30 domains all landed on nodes {owners:?}");
}
