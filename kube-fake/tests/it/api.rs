//! The server's semantics as kube-rs sees them.

use crate::job;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tuneq_kube_fake::{FakeCluster, Kind};

fn api_error(e: kube::Error) -> kube::core::Status {
    match e {
        kube::Error::Api(s) => *s,
        other => panic!("not an API error: {other:?}"),
    }
}

#[tokio::test]
async fn create_get_list_stamp_and_answer_with_the_real_reasons() {
    let cluster = FakeCluster::new();
    let jobs: Api<Job> = Api::default_namespaced(cluster.client());
    let created = jobs
        .create(
            &PostParams::default(),
            &job("a", json!({"app": "tuneq", "tier": "gpu"})),
        )
        .await
        .unwrap();
    let meta = &created.metadata;
    assert!(meta.uid.as_ref().is_some_and(|u| u.len() == 36));
    assert_eq!(meta.resource_version.as_deref(), Some("1"));
    assert_eq!(meta.generation, Some(1));
    assert!(meta.creation_timestamp.is_some());
    assert_eq!(meta.namespace.as_deref(), Some("default"));
    jobs.create(&PostParams::default(), &job("b", json!({"app": "other"})))
        .await
        .unwrap();

    let again = api_error(
        jobs.create(&PostParams::default(), &job("a", json!({})))
            .await
            .unwrap_err(),
    );
    assert!(again.is_already_exists(), "{again:?}");
    assert_eq!(again.code, 409);
    assert!(jobs.get_opt("nope").await.unwrap().is_none());
    let missing = api_error(jobs.get("nope").await.unwrap_err());
    assert!(missing.is_not_found());

    let names = |l: kube::core::ObjectList<Job>| -> Vec<String> {
        l.items
            .into_iter()
            .map(|j| j.metadata.name.unwrap())
            .collect()
    };
    for (selector, want) in [
        ("app=tuneq", vec!["a"]),
        ("app in (tuneq,other)", vec!["a", "b"]),
        ("app notin (tuneq)", vec!["b"]),
        ("tier", vec!["a"]),
        ("!tier", vec!["b"]),
        ("app!=tuneq", vec!["b"]),
    ] {
        let l = jobs
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap();
        assert_eq!(l.types.kind, "JobList");
        assert_eq!(names(l), want, "{selector}");
    }
    let by_name = jobs
        .list(&ListParams::default().fields("metadata.name=b"))
        .await
        .unwrap();
    assert_eq!(names(by_name), vec!["b"]);
    let other_ns: Api<Job> = Api::namespaced(cluster.client(), "elsewhere");
    assert!(
        other_ns
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    let all: Api<Job> = Api::all(cluster.client());
    let l = all
        .list(&ListParams::default().fields("metadata.namespace=default"))
        .await
        .unwrap();
    assert_eq!(l.items.len(), 2);
    assert_eq!(l.metadata.resource_version.as_deref(), Some("2"));

    // dryRun stores nothing.
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    jobs.create(&dry, &job("c", json!({}))).await.unwrap();
    assert!(jobs.get_opt("c").await.unwrap().is_none());
}

#[tokio::test]
async fn status_is_a_separate_subresource_and_patches_of_every_type_apply() {
    let cluster = FakeCluster::new();
    let jobs: Api<Job> = Api::default_namespaced(cluster.client());
    jobs.create(&PostParams::default(), &job("a", json!({"app": "tuneq"})))
        .await
        .unwrap();
    let pp = PatchParams::default();

    // Status writes ignore spec; main writes ignore status.
    let j = jobs
        .patch_status(
            "a",
            &pp,
            &Patch::Merge(json!({"status": {"active": 1}, "spec": {"backoffLimit": 7}})),
        )
        .await
        .unwrap();
    assert_eq!(j.status.unwrap().active, Some(1));
    assert_eq!(j.spec.unwrap().backoff_limit, Some(0));
    let j = jobs
        .patch(
            "a",
            &pp,
            &Patch::Merge(json!({"status": {"active": 5}, "spec": {"backoffLimit": 3}})),
        )
        .await
        .unwrap();
    assert_eq!(j.status.as_ref().unwrap().active, Some(1));
    assert_eq!(j.spec.unwrap().backoff_limit, Some(3));
    assert_eq!(
        j.metadata.generation,
        Some(2),
        "a spec change bumps the generation"
    );

    // Label-only patches keep the generation; null deletes (RFC 7386).
    let j = jobs
        .patch(
            "a",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"app": null, "x": "y"}}})),
        )
        .await
        .unwrap();
    assert_eq!(j.metadata.generation, Some(2));
    assert_eq!(
        j.metadata.labels.unwrap().into_iter().collect::<Vec<_>>(),
        vec![("x".into(), "y".into())]
    );

    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "replace", "path": "/spec/backoffLimit", "value": 4}
    ]))
    .unwrap();
    let j = jobs.patch("a", &pp, &Patch::<()>::Json(ops)).await.unwrap();
    assert_eq!(j.spec.unwrap().backoff_limit, Some(4));
    let j = jobs
        .patch(
            "a",
            &pp,
            &Patch::Strategic(json!({"metadata": {"annotations": {"k": "v"}}})),
        )
        .await
        .unwrap();
    assert_eq!(j.metadata.annotations.unwrap()["k"], "v");

    // A stale resourceVersion in the patch: 409 Conflict.
    let stale = api_error(
        jobs.patch(
            "a",
            &pp,
            &Patch::Merge(json!({"metadata": {"resourceVersion": "1", "labels": {"z": "1"}}})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!((stale.code, stale.reason.as_str()), (409, "Conflict"));

    // Server-side apply creates what is missing.
    let apply = PatchParams::apply("tuneq");
    let j = jobs
        .patch(
            "b",
            &apply,
            &Patch::Apply(job("b", json!({"app": "tuneq"}))),
        )
        .await
        .unwrap();
    assert!(j.metadata.uid.is_some());
    assert!(jobs.get_opt("b").await.unwrap().is_some());
    let missing = api_error(
        jobs.patch("nope", &pp, &Patch::Merge(json!({})))
            .await
            .unwrap_err(),
    );
    assert!(missing.is_not_found());

    // PUT is refused and recorded.
    let current = jobs.get("a").await.unwrap();
    let put = api_error(
        jobs.replace("a", &PostParams::default(), &current)
            .await
            .unwrap_err(),
    );
    assert_eq!(put.code, 405);
    let log = cluster.requests();
    assert_eq!(log.iter().filter(|r| r.method == "PUT").count(), 1);
    let patch_types: Vec<_> = log
        .iter()
        .filter(|r| r.method == "PATCH")
        .filter_map(|r| r.content_type.clone())
        .collect();
    assert!(patch_types.contains(&"application/apply-patch+yaml".to_string()));
    assert!(patch_types.contains(&"application/json-patch+json".to_string()));
}

#[tokio::test]
async fn deletes_follow_their_propagation_policy() {
    let cluster = FakeCluster::new();
    let client = cluster.client();
    let jobs: Api<Job> = Api::default_namespaced(client.clone());
    let pods: Api<Pod> = Api::default_namespaced(client);
    for name in ["orphan", "background", "foreground"] {
        jobs.create(&PostParams::default(), &job(name, json!({"app": "tuneq"})))
            .await
            .unwrap();
    }
    cluster.sync_jobs();
    let pod_of = |j: &str| cluster.pods_of(j).pop().unwrap();
    let (orphan_pod, background_pod, foreground_pod) =
        (pod_of("orphan"), pod_of("background"), pod_of("foreground"));
    for p in [&orphan_pod, &background_pod, &foreground_pod] {
        cluster.schedule(p, "node-1").unwrap();
        cluster.run(p).unwrap();
    }
    let owner = |p: &Pod| p.metadata.owner_references.clone().unwrap_or_default();
    let controller = owner(&pods.get(&orphan_pod).await.unwrap());
    assert_eq!(controller[0].controller, Some(true));
    assert_eq!(controller[0].kind, "Job");

    // No policy on a Job: orphaned, as the real server does.
    jobs.delete("orphan", &DeleteParams::default())
        .await
        .unwrap();
    assert!(jobs.get_opt("orphan").await.unwrap().is_none());
    let p = pods.get(&orphan_pod).await.unwrap();
    assert!(owner(&p).is_empty() && p.metadata.deletion_timestamp.is_none());

    // Background: the pod is deleted with its grace; it stays until the kubelet ends it
    // and the Job controller releases it.
    jobs.delete("background", &DeleteParams::background())
        .await
        .unwrap();
    assert!(jobs.get_opt("background").await.unwrap().is_none());
    let p = pods.get(&background_pod).await.unwrap();
    assert!(p.metadata.deletion_timestamp.is_some());
    assert_eq!(p.metadata.deletion_grace_period_seconds, Some(25));
    cluster.exit(&background_pod, 143, "Error", None).unwrap();
    cluster.sync_jobs();
    assert!(pods.get_opt(&background_pod).await.unwrap().is_none());

    // Foreground: the Job stays, deleting, until its pod is gone.
    jobs.delete("foreground", &DeleteParams::foreground())
        .await
        .unwrap();
    let j = jobs.get("foreground").await.unwrap();
    assert!(j.metadata.deletion_timestamp.is_some());
    assert!(
        j.metadata
            .finalizers
            .unwrap()
            .contains(&"foregroundDeletion".to_string())
    );
    cluster.exit(&foreground_pod, 143, "Error", None).unwrap();
    cluster.sync_jobs();
    assert!(pods.get_opt(&foreground_pod).await.unwrap().is_none());
    assert!(jobs.get_opt("foreground").await.unwrap().is_none());

    // A pod deleted with grace 0 is gone at once; dryRun deletes nothing.
    let dry = DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    };
    pods.delete(&orphan_pod, &dry).await.unwrap();
    assert!(
        pods.get_opt(&orphan_pod)
            .await
            .unwrap()
            .is_none_or(|p| p.metadata.deletion_timestamp.is_none())
    );
    cluster.sync_jobs(); // releases the orphan's tracking finalizer
    pods.delete(&orphan_pod, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    assert!(pods.get_opt(&orphan_pod).await.unwrap().is_none());

    // The log tells which DELETE carried which policy.
    let deletes: Vec<_> = cluster
        .requests()
        .into_iter()
        .filter(|r| r.method == "DELETE")
        .map(|r| {
            (
                r.path.rsplit('/').next().unwrap().to_string(),
                r.param("propagationPolicy"),
            )
        })
        .collect();
    assert_eq!(deletes[0], ("orphan".into(), None));
    assert_eq!(deletes[1], ("background".into(), Some("Background".into())));
    assert_eq!(deletes[2], ("foreground".into(), Some("Foreground".into())));
    assert!(cluster.get(Kind::Job, "orphan").is_none());
}

#[tokio::test]
async fn the_loopback_server_answers_a_client_built_from_its_kubeconfig() {
    let cluster = FakeCluster::new();
    let (addr, task) = cluster.serve().await.unwrap();
    let yaml = tuneq_kube_fake::kubeconfig(addr);
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&yaml).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let jobs: Api<Job> = Api::default_namespaced(client);
    jobs.create(
        &PostParams::default(),
        &job("a", json!({"app.kubernetes.io/managed-by": "tuneq"})),
    )
    .await
    .unwrap();
    let l = jobs
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=tuneq"))
        .await
        .unwrap();
    assert_eq!(l.items.len(), 1);
    let list = cluster
        .requests()
        .into_iter()
        .find(|r| r.method == "GET")
        .unwrap();
    assert_eq!(
        list.query_param("labelSelector"),
        Some("app.kubernetes.io/managed-by=tuneq")
    );
    assert!(cluster.get(Kind::Job, "default/a").is_some());
    task.abort();
}

/// One raw request to the fake: its status code and JSON body.
async fn raw(
    cluster: &FakeCluster,
    method: &str,
    uri: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let request = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let response = cluster.service().oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap())
}

#[tokio::test]
async fn delete_and_not_found_answers_have_the_real_servers_shape() {
    // The shapes kube-apiserver v1.36.2 answered to the same requests (curl, by hand).
    let cluster = FakeCluster::new();
    let jobs: Api<Job> = Api::default_namespaced(cluster.client());
    let created = jobs
        .create(&PostParams::default(), &job("gone", json!({})))
        .await
        .unwrap();
    jobs.create(&PostParams::default(), &job("kept", json!({})))
        .await
        .unwrap();
    cluster.sync_jobs();
    let pod = cluster.pods_of("kept").pop().unwrap();
    cluster.schedule(&pod, "node-1").unwrap();
    cluster.run(&pod).unwrap();

    // A Job gone at once: a Success Status naming it, not the object.
    let (code, body) = raw(
        &cluster,
        "DELETE",
        "/apis/batch/v1/namespaces/default/jobs/gone",
        json!({"propagationPolicy": "Background"}),
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(
        body,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
               "details": {"name": "gone", "group": "batch", "kind": "jobs",
                           "uid": created.metadata.uid.unwrap()}})
    );
    // A pod kept for its grace period: the pod, with 200 (202 only for
    // `orphanDependents: false`).
    let pod_uri = format!("/api/v1/namespaces/default/pods/{pod}");
    let (code, body) = raw(
        &cluster,
        "DELETE",
        &pod_uri,
        json!({"gracePeriodSeconds": 20}),
    )
    .await;
    assert_eq!((code, body["kind"].as_str()), (200, Some("Pod")));
    assert_eq!(body["metadata"]["deletionGracePeriodSeconds"], 20);
    let (code, _) = raw(
        &cluster,
        "DELETE",
        &pod_uri,
        json!({"orphanDependents": false}),
    )
    .await;
    assert_eq!(code, 202);

    // Not found: `details.group` is left out for the core group.
    let (code, body) = raw(
        &cluster,
        "GET",
        "/api/v1/namespaces/default/pods/nope",
        json!({}),
    )
    .await;
    assert_eq!(code, 404);
    assert_eq!(body["details"], json!({"name": "nope", "kind": "pods"}));
    let (_, body) = raw(
        &cluster,
        "GET",
        "/apis/batch/v1/namespaces/default/jobs/nope",
        json!({}),
    )
    .await;
    assert_eq!(
        body["details"],
        json!({"name": "nope", "group": "batch", "kind": "jobs"})
    );
}
