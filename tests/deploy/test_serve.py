"""The `serve` Deployment (`tuneq serve`: the API with inference on): absent unless
serve.enabled; when on, the same arguments, environment, files, identity and probes as
the API plus its inference settings and a writable model cache; a Service, a PDB, the
bundled Redis's NetworkPolicy letting it in; and placed where the shipped values say
(GKE: on-demand CPU nodes, the engine generating on the CPU; Xeon: nodes of its own). tests/deploy's other
files check it too, as every workload: schema, policies, Kustomize, and (test_local_processes)
the rendered pod run here until it answers a chat completion."""

from __future__ import annotations

import pytest
import yaml

import tuneq_chart
from conftest import CASES, REPO_ROOT, find, pod_spec
from test_chart import kubernetes_validate

ENABLED = ["gke-spot-l4", "xeon", "everything"]
SERVE_ONLY_ENV = {"TUNEQ_MAX_GENERATIONS", "TUNEQ_MAX_GENERATIONS_PER_TENANT", "TUNEQ_RESIDENT_MODELS",
                  "TUNEQ_STAGED_ADAPTERS", "TUNEQ_CACHE_DIR", "TUNEQ_THREADS"}


def container(deployment: dict) -> dict:
    (c,) = pod_spec(deployment)["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


def render(case: str, override: dict | None = None) -> list[dict]:
    values = tuneq_chart.load_values(CASES[case])
    if override:
        tuneq_chart.merge(values, override)
    return tuneq_chart.objects(tuneq_chart.render(values))


def serve_objects(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["metadata"]["name"] == "tuneq-serve"
            or o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "serve"]


def test_serve_is_absent_unless_enabled(rendered) -> None:
    objs = rendered["kustomize-base"]
    assert not serve_objects(objs)
    redis_policy = find(objs, "NetworkPolicy", "tuneq-redis")
    components = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                  for p in redis_policy["spec"]["ingress"][0]["from"]]
    assert components == ["api", "dispatcher"]
    notes = tuneq_chart.render(tuneq_chart.load_values(CASES["kustomize-base"]))["tuneq/templates/NOTES.txt"]
    assert "tuneq-serve" not in notes
    # Switched on by one value, with the chart's defaults for the rest.
    on = render("kustomize-base", {"serve": {"enabled": True}})
    kinds = sorted(o["kind"] for o in serve_objects(on))
    assert kinds == ["Deployment", "PodDisruptionBudget", "Service"]
    c = container(find(on, "Deployment", "tuneq-serve"))
    env = env_of(c)
    assert env["TUNEQ_MAX_GENERATIONS"]["value"] == "4"
    # A shared deployment: one tenant's burst cannot take every slot.
    assert env["TUNEQ_MAX_GENERATIONS_PER_TENANT"]["value"] == "2"
    assert env["TUNEQ_RESIDENT_MODELS"]["value"] == "4"
    assert env["TUNEQ_STAGED_ADAPTERS"]["value"] == "64"
    assert "TUNEQ_THREADS" not in env
    assert c["image"] == container(find(on, "Deployment", "tuneq-api"))["image"]
    cache = next(v for v in pod_spec(find(on, "Deployment", "tuneq-serve"))["volumes"] if v["name"] == "cache")
    assert cache == {"name": "cache", "emptyDir": {"sizeLimit": "50Gi"}}


@pytest.mark.parametrize("case", ENABLED)
def test_serve_runs_tuneq_serve_with_the_apis_settings(case: str, rendered) -> None:
    objs = rendered[case]
    api, serve = find(objs, "Deployment", "tuneq-api"), find(objs, "Deployment", "tuneq-serve")
    a, s = container(api), container(serve)
    assert s["name"] == "serve"
    assert a["args"][0] == "api" and s["args"][0] == "serve"
    assert s["args"][1:] == a["args"][1:], "serve takes the API's flags (--max-upload-mib, --model)"
    # Every variable of the API, the same (the port aside), and the inference settings.
    a_env, s_env = env_of(a), env_of(s)
    for name, entry in a_env.items():
        if name == "TUNEQ_PORT":
            continue
        assert s_env.get(name) == entry, f"{name}: serve {s_env.get(name)} != api {entry}"
    assert set(s_env) - set(a_env) <= SERVE_ONLY_ENV
    assert {"TUNEQ_MAX_GENERATIONS", "TUNEQ_RESIDENT_MODELS", "TUNEQ_CACHE_DIR"} <= set(s_env)
    for name in ("TUNEQ_REDIS_URL", "TUNEQ_ATTEMPT_SECRET", "TUNEQ_POOLS", "TUNEQ_STORE"):
        assert name in s_env, name
    values = tuneq_chart.load_values(CASES[case])["serve"]
    assert s_env["TUNEQ_MAX_GENERATIONS"]["value"] == str(values.get("maxGenerations", 4))
    assert s_env["TUNEQ_RESIDENT_MODELS"]["value"] == str(values.get("residentModels", 4))
    if values.get("threads"):
        assert s_env["TUNEQ_THREADS"]["value"] == str(values["threads"])
    port = s["ports"][0]
    assert port["name"] == "http" and s_env["TUNEQ_PORT"]["value"] == str(port["containerPort"])
    assert s_env["TUNEQ_HOST"]["value"] == "0.0.0.0"
    # The cache is a writable volume of its own; the API's files are all there.
    mounts = {m["mountPath"]: m for m in s["volumeMounts"]}
    cache = mounts[s_env["TUNEQ_CACHE_DIR"]["value"]]
    assert not cache.get("readOnly")
    spec, api_spec = pod_spec(serve), pod_spec(api)
    volume = next(v for v in spec["volumes"] if v["name"] == cache["name"])
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume, volume
    assert a["volumeMounts"] == [m for m in s["volumeMounts"] if m["name"] != cache["name"]]
    assert api_spec["volumes"] == [v for v in spec["volumes"] if v["name"] != cache["name"]]
    # Probes, identity, security, checksums as the API's.
    assert s["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert s["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert s["securityContext"] == a["securityContext"]
    assert spec["securityContext"] == api_spec["securityContext"]
    assert spec["serviceAccountName"] == api_spec["serviceAccountName"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    annotations = serve["spec"]["template"]["metadata"]["annotations"]
    api_annotations = api["spec"]["template"]["metadata"]["annotations"]
    for k in ("checksum/pools", "checksum/storage"):
        assert annotations[k] == api_annotations[k]
    if annotations.get("prometheus.io/scrape") == "true":
        assert annotations["prometheus.io/port"] == str(port["containerPort"])
    assert serve["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # Labels and selectors: component serve, never matching the API's pods.
    selector = serve["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/component"] == "serve"
    assert selector.items() <= serve["spec"]["template"]["metadata"]["labels"].items()
    assert not selector.items() <= api["spec"]["template"]["metadata"]["labels"].items()
    service = find(objs, "Service", "tuneq-serve")
    assert service["spec"]["selector"] == selector
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert find(objs, "PodDisruptionBudget", "tuneq-serve")["spec"]["selector"]["matchLabels"] == selector


@pytest.mark.parametrize("case", ENABLED)
def test_the_bundled_redis_lets_serve_in(case: str, rendered) -> None:
    objs = rendered[case]
    policies = [o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "tuneq-redis"]
    if not policies:
        assert not [o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "tuneq-redis"]
        return
    labels = find(objs, "Deployment", "tuneq-serve")["spec"]["template"]["metadata"]["labels"]
    sources = [p["podSelector"]["matchLabels"] for rule in policies[0]["spec"]["ingress"] for p in rule["from"]]
    assert any(s.items() <= labels.items() for s in sources), sources


@pytest.mark.parametrize("case", sorted(CASES))
def test_extended_resources_are_requested_as_limited(case: str, rendered) -> None:
    """Kubernetes refuses a GPU limit that its request does not equal."""
    for obj in rendered[case]:
        spec = pod_spec(obj)
        for c in (spec or {}).get("containers", []):
            limits, requests = c["resources"].get("limits", {}), c["resources"].get("requests", {})
            for name in {*limits, *requests} - {"cpu", "memory", "ephemeral-storage"}:
                where = (obj["metadata"]["name"], name)
                assert name in limits and int(limits[name]) == int(requests.get(name, limits[name])), where


def test_gke_puts_serve_on_on_demand_cpu_nodes_without_a_gpu(rendered) -> None:
    """The engine generates on the CPU, so GKE serving takes no L4 (a GPU it cannot use)."""
    objs = rendered["gke-spot-l4"]
    serve = find(objs, "Deployment", "tuneq-serve")
    spec, c = pod_spec(serve), container(serve)
    assert "nvidia.com/gpu" not in str(c["resources"])
    assert "nvidia" not in str(spec.get("nodeSelector")) + str(spec.get("tolerations"))
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "cloud.google.com/gke-spot", "operator": "DoesNotExist"}]}]
    assert c["image"] == container(find(objs, "Deployment", "tuneq-api"))["image"]


def test_xeon_puts_serve_on_xeon_nodes_of_its_own_with_the_model_cache(rendered) -> None:
    objs = rendered["xeon"]
    serve = find(objs, "Deployment", "tuneq-serve")
    spec, c = pod_spec(serve), container(serve)
    assert spec["nodeSelector"] == {"tuneq.io/pool": "xeon-serve"}
    assert spec["tolerations"] == [{"key": "tuneq.io/pool", "operator": "Equal", "value": "xeon-serve",
                                    "effect": "NoSchedule"}]
    assert c["resources"]["requests"] == c["resources"]["limits"], "Guaranteed QoS, as the training pool"
    assert env_of(c)["TUNEQ_THREADS"]["value"] == str(int(c["resources"]["limits"]["cpu"]))
    cache = next(v for v in spec["volumes"] if v["name"] == "cache")
    claim = find(objs, "PersistentVolumeClaim", "tuneq-model-cache")
    assert cache["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]


def test_every_option_renders(rendered) -> None:
    objs = rendered["everything"]
    serve = find(objs, "Deployment", "tuneq-serve")
    assert "replicas" not in serve["spec"], "the HorizontalPodAutoscaler owns the count"
    hpa = find(objs, "HorizontalPodAutoscaler", "tuneq-serve")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "tuneq-serve"
    monitor = find(objs, "ServiceMonitor", "tuneq-serve")
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    assert monitor["spec"]["selector"]["matchLabels"] == serve["spec"]["selector"]["matchLabels"]
    c = container(serve)
    assert c["image"].startswith("registry.example.com/tuneq/tuneq-cuda@sha256:")
    cache = next(v for v in pod_spec(serve)["volumes"] if v["name"] == "cache")
    assert cache["persistentVolumeClaim"]["claimName"] == "tuneq-serve-cache"
    assert find(objs, "Service", "tuneq-serve")["spec"]["ports"][0]["port"] == 8080


@pytest.mark.parametrize("serve_image,want", [
    ({}, "registry.example.com/tuneq/tuneq:0.1.0"),
    ({"tag": "0.2.0"}, "registry.example.com/tuneq/tuneq:0.2.0"),
    ({"repository": "registry.example.com/tuneq/tuneq-cuda"}, "registry.example.com/tuneq/tuneq-cuda:0.1.0"),
    ({"repository": "r.example.com/t", "digest": "sha256:" + "ab" * 32}, "r.example.com/t@sha256:" + "ab" * 32),
])
def test_the_serve_image_falls_back_to_the_main_image(serve_image: dict, want: str) -> None:
    objs = render("xeon", {"serve": {"image": serve_image}})
    assert container(find(objs, "Deployment", "tuneq-serve"))["image"] == want


def test_an_unset_serve_image_is_the_main_image_by_digest_too() -> None:
    digest = "sha256:" + "cd" * 32
    objs = render("xeon", {"image": {"digest": digest}})
    assert container(find(objs, "Deployment", "tuneq-serve"))["image"] == f"registry.example.com/tuneq/tuneq@{digest}"


def test_serve_settings_follow_the_values() -> None:
    objs = render("xeon", {"serve": {"maxGenerations": 7, "maxGenerationsPerTenant": 3, "residentModels": 2,
                                     "stagedAdapters": 9, "threads": 0, "port": 9000,
                                     "cache": {"useModelCache": False, "sizeLimit": "20Gi"}}})
    c = container(find(objs, "Deployment", "tuneq-serve"))
    env = env_of(c)
    assert (env["TUNEQ_MAX_GENERATIONS"]["value"], env["TUNEQ_RESIDENT_MODELS"]["value"]) == ("7", "2")
    assert env["TUNEQ_MAX_GENERATIONS_PER_TENANT"]["value"] == "3"
    assert env["TUNEQ_STAGED_ADAPTERS"]["value"] == "9"
    # A tenant's share past all the slots is all the slots.
    capped = render("xeon", {"serve": {"maxGenerations": 2, "maxGenerationsPerTenant": 5}})
    capped_env = env_of(container(find(capped, "Deployment", "tuneq-serve")))
    assert capped_env["TUNEQ_MAX_GENERATIONS_PER_TENANT"]["value"] == "2"
    assert "TUNEQ_THREADS" not in env
    assert env["TUNEQ_PORT"]["value"] == "9000" and c["ports"][0]["containerPort"] == 9000
    cache = next(v for v in pod_spec(find(objs, "Deployment", "tuneq-serve"))["volumes"] if v["name"] == "cache")
    assert cache["emptyDir"] == {"sizeLimit": "20Gi"}


@pytest.mark.parametrize("override,complaint", [
    ({"serve": {"replica": 2}}, "replica"),
    ({"serve": {"enabled": "yes"}}, "/serve/enabled"),
    ({"serve": {"maxGenerations": 0}}, "/serve/maxGenerations"),
    ({"serve": {"maxGenerationsPerTenant": 0}}, "/serve/maxGenerationsPerTenant"),
    ({"serve": {"residentModels": 0}}, "/serve/residentModels"),
    ({"serve": {"stagedAdapters": 0}}, "/serve/stagedAdapters"),
    ({"serve": {"image": {"tag": "latest"}}}, "/serve/image/tag"),
    ({"serve": {"resources": {"limits": None}}}, "limits"),
    ({"serve": {"resources": {"limits": {"nvidia.com/gpu": "one"}}}}, "nvidia.com~1gpu"),
    ({"serve": {"resources": {"requests": {"gpu": 1}}}}, "/serve/resources/requests"),
    ({"serve": {"cache": {"existingClaim": "Not_A_Name"}}}, "/serve/cache/existingClaim"),
    ({"serve": {"cache": {"size": "10Gi"}}}, "size"),
])
def test_the_schema_refuses_bad_serve_values(override: dict, complaint: str) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmValuesError) as refused:
        render("xeon", override)
    assert complaint in str(refused.value), str(refused.value)


@pytest.mark.parametrize("override,complaint", [
    ({"trainer": {"modelCache": {"enabled": False}}}, "trainer.modelCache.enabled"),
    ({"serve": {"cache": {"existingClaim": "mine"}}}, "not both"),
])
def test_the_cache_choice_is_checked(override: dict, complaint: str) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError) as refused:
        render("xeon", override)
    assert complaint in str(refused.value), str(refused.value)


def test_the_routing_examples_send_the_chat_paths_to_serve(rendered) -> None:
    """deploy/README.md's Ingress and HTTPRoute name the Services and ports the chart
    renders, send exactly the chat paths to serve, and the Ingress passes the strict
    schema check (the HTTPRoute is a CRD: checked by structure only)."""
    text = (REPO_ROOT / "deploy" / "README.md").read_text()
    section = text.split("## Serving the models: `tuneq serve`", 1)[1].split("\n## ", 1)[0]
    docs = [yaml.safe_load(b.split("```", 1)[0]) for b in section.split("```yaml")[1:]]
    ingress = next(d for d in docs if d["kind"] == "Ingress")
    route = next(d for d in docs if d["kind"] == "HTTPRoute")
    services = {o["metadata"]["name"]: o for o in rendered["xeon"] if o["kind"] == "Service"}
    chat = {"/v1/chat/completions", "/v1/responses"}

    routed = {}
    for path in ingress["spec"]["rules"][0]["http"]["paths"]:
        backend = path["backend"]["service"]
        ports = [p["name"] for p in services[backend["name"]]["spec"]["ports"]]
        assert backend["port"]["name"] in ports
        routed[path["path"]] = backend["name"]
    assert routed == {**{p: "tuneq-serve" for p in chat}, "/": "tuneq-api"}
    result = kubernetes_validate([ingress])
    assert result.returncode == 0, result.stdout + result.stderr

    routed = {}
    for rule in route["spec"]["rules"]:
        (backend,) = rule["backendRefs"]
        assert backend["port"] in [p["port"] for p in services[backend["name"]]["spec"]["ports"]]
        for match in rule["matches"]:
            routed[match["path"]["value"]] = backend["name"]
    assert routed == {**{p: "tuneq-serve" for p in chat}, "/": "tuneq-api"}
