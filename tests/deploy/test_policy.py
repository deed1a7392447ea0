"""Policies on the chart's rendered output, for every values set: what a platform team's
admission policies (PodSecurity "restricted", Kyverno/Gatekeeper baselines) would demand,
plus tuneq's own rules — RBAC exactly as deploy/helm/tuneq/files/dispatcher-rbac.json
lists it (the one list of what the dispatcher's runtime calls, cross-checked here against
dispatcher/src/kubernetes/ and README.md), the Redis StatefulSet's AOF, and the pools
file agreeing with the objects the chart creates."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
import yaml

from conftest import CASES, CHART, REPO_ROOT, find, pod_spec

RBAC = json.loads((CHART / "files" / "dispatcher-rbac.json").read_text())
SECRETISH = re.compile(r"(SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|ADMIN_KEY|API_KEY|PRIVATE_KEY)", re.I)
INLINE_SECRET_KEYS = re.compile(r"(secret_access_key|password|private_key|api_key|admin_key|token)\s*[=:]", re.I)

cases = pytest.mark.parametrize("case", sorted(CASES))


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def workloads(objs: list[dict]) -> list[tuple[dict, dict]]:
    return [(o, pod_spec(o)) for o in objs if pod_spec(o) is not None]


@cases
def test_every_container_has_requests_and_limits(case, rendered) -> None:
    for obj, spec in workloads(rendered[case]):
        for c in containers(spec):
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                for what in ("cpu", "memory"):
                    assert what in res.get(part, {}), f"{obj['metadata']['name']}/{c['name']}: no {part}.{what}"


@cases
def test_every_container_runs_non_root_read_only_without_privileges(case, rendered) -> None:
    for obj, spec in workloads(rendered[case]):
        pod_ctx = spec.get("securityContext", {})
        assert pod_ctx.get("runAsNonRoot") is True, obj["metadata"]["name"]
        assert pod_ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault", obj["metadata"]["name"]
        assert spec.get("hostNetwork") is not True and spec.get("hostPID") is not True
        for c in containers(spec):
            ctx = c.get("securityContext", {})
            where = f"{obj['metadata']['name']}/{c['name']}"
            assert ctx.get("runAsNonRoot") is True, where
            assert ctx.get("runAsUser", pod_ctx.get("runAsUser", 0)) != 0, where
            assert ctx.get("readOnlyRootFilesystem") is True, where
            assert ctx.get("allowPrivilegeEscalation") is False, where
            assert ctx.get("privileged") is not True, where
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not ctx.get("capabilities", {}).get("add"), where


@cases
def test_images_are_pinned(case, rendered) -> None:
    images = [c["image"] for _, spec in workloads(rendered[case]) for c in containers(spec)]
    pools = tomllib.loads(find(rendered[case], "ConfigMap", "tuneq-pools")["data"]["pools.toml"])
    images += [p["kubernetes"]["image"] for p in pools["pool"] if "kubernetes" in p]
    for image in images:
        name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
        assert "@sha256:" in image or (name and tag and tag != "latest" and "/" not in tag), image


@cases
def test_no_secret_value_is_inline(case, rendered) -> None:
    objs = rendered[case]
    assert not [o for o in objs if o["kind"] == "Secret"], "the chart creates no Secret: secrets by reference only"
    for obj, spec in workloads(objs):
        for c in containers(spec):
            for env in c.get("env", []):
                value = env.get("value")
                if value is None:
                    continue
                where = f"{obj['metadata']['name']}/{c['name']} env {env['name']}"
                if SECRETISH.search(env["name"]) and not env["name"].endswith("_FILE"):
                    raise AssertionError(f"{where} is a secret given inline; use valueFrom.secretKeyRef")
                # A URL's password may only be a reference to another variable.
                for password in re.findall(r"://[^/@\s]*:([^@/\s]+)@", value):
                    assert re.fullmatch(r"\$\([A-Z_][A-Z0-9_]*\)", password), f"{where}: inline password"
            for arg in c.get("args", []) + c.get("command", []):
                assert not re.search(r"://[^/@\s]*:[^$@/\s][^@/\s]*@", arg), f"inline password in args: {arg}"
    for obj in objs:
        if obj["kind"] == "ConfigMap":
            for name, text in obj.get("data", {}).items():
                if name.endswith(".json"):
                    continue
                assert not INLINE_SECRET_KEYS.search(text), f"ConfigMap {obj['metadata']['name']}/{name} holds a secret"


def rules(rule_list: list[dict]) -> list[tuple]:
    return sorted((tuple(r.get("apiGroups", [])), tuple(r["resources"]), tuple(sorted(r["verbs"])),
                   tuple(r.get("resourceNames", []))) for r in rule_list)


@cases
def test_rbac_is_namespaced_and_grants_exactly_the_listed_verbs(case, rendered) -> None:
    objs = rendered[case]
    values = yaml.safe_load(CASES[case][0].read_text())
    pools = tomllib.loads(find(objs, "ConfigMap", "tuneq-pools")["data"]["pools.toml"])
    pool_namespaces = {p["kubernetes"]["namespace"] for p in pools["pool"] if "kubernetes" in p}
    roles = [o for o in objs if o["kind"] == "Role"]
    assert {r["metadata"]["namespace"] for r in roles} >= pool_namespaces, \
        "the dispatcher needs its Role in every pool's namespace"
    for role in roles:
        assert rules(role["rules"]) == rules(RBAC["namespaced"]), role["metadata"]
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
    bindings = [o for o in objs if o["kind"] == "RoleBinding"]
    assert len(bindings) == len(roles)
    for b in bindings:
        assert [s["name"] for s in b["subjects"]] == ["tuneq-dispatcher"]
    cluster_roles = [o for o in objs if o["kind"] == "ClusterRole"]
    cluster_bindings = [o for o in objs if o["kind"] == "ClusterRoleBinding"]
    if values.get("dispatcher", {}).get("readNodes"):
        assert len(cluster_roles) == 1 and len(cluster_bindings) == 1
        assert rules(cluster_roles[0]["rules"]) == rules(RBAC["cluster_optional"])
        assert cluster_bindings[0]["subjects"][0]["name"] == "tuneq-dispatcher"
    else:
        assert not cluster_roles and not cluster_bindings, "nothing cluster-wide unless dispatcher.readNodes"


# The runtime's calls: `self.jobs.create(`, `self\n    .pods\n    .list(` (as rustfmt breaks
# long chains) …
CALL = re.compile(r"self\s*\.\s*(jobs|pods|secrets|nodes)\s*\.\s*(create|get|list|watch|delete|patch|replace|"
                  r"delete_collection|evict|get_opt|entry|replace_status|patch_status)\b")
RESOURCE = {"jobs": ("batch", "jobs"), "pods": ("", "pods"), "secrets": ("", "secrets"), "nodes": ("", "nodes")}
VERB = {"get_opt": "get", "entry": "get", "delete_collection": "deletecollection",
        "replace": "update", "replace_status": "update", "patch_status": "patch", "evict": "create"}


# …and its watches: `jobs: Watched::start(Api::namespaced(…` is a reflector (list + watch).
WATCHED = re.compile(r"\b(jobs|pods|secrets|nodes)\s*:\s*Watched::start\(")


def code_calls() -> set[tuple[str, str, str]]:
    calls = set()
    for path in (REPO_ROOT / "dispatcher" / "src" / "kubernetes").glob("*.rs"):
        text = path.read_text()
        for field, method in CALL.findall(text):
            group, resource = RESOURCE[field]
            calls.add((group, resource, VERB.get(method, method)))
        for field in WATCHED.findall(text):
            group, resource = RESOURCE[field]
            calls |= {(group, resource, "list"), (group, resource, "watch")}
    return calls


def granted() -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in RBAC["namespaced"] + RBAC["cluster_optional"]
            for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_every_call_the_runtime_makes_is_granted() -> None:
    calls = code_calls()
    assert calls, "no Kubernetes calls found in dispatcher/src/kubernetes/: has the code moved?"
    missing = calls - granted()
    assert not missing, f"dispatcher/src/kubernetes/ calls {sorted(missing)}, which dispatcher-rbac.json does not grant"


def test_nothing_is_granted_that_the_runtime_has_no_use_for() -> None:
    """No verb the runtime does not call is granted (pods/log, events, a pod `get`, …).
    This reads the calls from the source text, a rough reading: when it misses a new
    call shape, the test above fails first (a 403 in production otherwise)."""
    unused = granted() - code_calls()
    assert not unused, f"dispatcher-rbac.json grants {sorted(unused)}, which dispatcher/src/kubernetes/ never calls"


def test_the_readme_shows_the_same_rbac() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    block = readme.split("RBAC the dispatcher needs", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    docs = [d for d in yaml.safe_load_all(block) if d]
    role = next(d for d in docs if d["kind"] == "Role")
    cluster = next(d for d in docs if d["kind"] == "ClusterRole")
    assert rules(role["rules"]) == rules(RBAC["namespaced"]), "README.md's Role differs from dispatcher-rbac.json"
    assert rules(cluster["rules"]) == rules(RBAC["cluster_optional"])


@cases
def test_bundled_redis_keeps_aof_on_a_volume_with_a_password(case, rendered) -> None:
    redis = [o for o in rendered[case] if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "tuneq-redis"]
    if yaml.safe_load(CASES[case][0].read_text()).get("redis", {}).get("mode", "bundled") != "bundled":
        assert not redis
        return
    (sts,) = redis
    c = sts["spec"]["template"]["spec"]["containers"][0]
    args = c["command"] + c["args"]
    pairs = dict(zip(args[1::2], args[2::2]))
    assert pairs["--appendonly"] == "yes"
    assert pairs["--appendfsync"] in ("everysec", "always")
    assert pairs["--maxmemory-policy"] == "noeviction", "a queue must never lose keys to eviction"
    assert pairs["--requirepass"] == "$(REDIS_PASSWORD)"
    assert any(e["name"] == "REDIS_PASSWORD" and "secretKeyRef" in e.get("valueFrom", {}) for e in c["env"])
    data = next(m for m in c["volumeMounts"] if m["mountPath"] == pairs["--dir"])
    assert data["name"] in [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]], \
        "the AOF lives on a PersistentVolumeClaim"


@cases
def test_the_workloads_have_the_shape_the_issue_asks_for(case, rendered) -> None:
    objs = rendered[case]
    values = yaml.safe_load(CASES[case][0].read_text())
    api = find(objs, "Deployment", "tuneq-api")
    if not values.get("api", {}).get("autoscaling", {}).get("enabled"):
        assert api["spec"]["replicas"] == 2
    else:
        find(objs, "HorizontalPodAutoscaler", "tuneq-api")
    c = api["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    find(objs, "Service", "tuneq-api")
    find(objs, "PodDisruptionBudget", "tuneq-api")
    dispatcher = find(objs, "Deployment", "tuneq-dispatcher")
    assert dispatcher["spec"]["replicas"] == 1
    assert dispatcher["spec"]["strategy"] == {"type": "Recreate"}
    assert api["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@cases
def test_the_pools_file_names_what_the_chart_creates(case, rendered) -> None:
    objs = rendered[case]
    pools = tomllib.loads(find(objs, "ConfigMap", "tuneq-pools")["data"]["pools.toml"])
    accounts = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs if o["kind"] == "ServiceAccount"}
    claims = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs if o["kind"] == "PersistentVolumeClaim"}
    policies = {o["metadata"]["namespace"] for o in objs if o["kind"] == "NetworkPolicy"
                and o["metadata"]["name"] == "tuneq-trainers"}
    for pool in pools["pool"]:
        k = pool.get("kubernetes")
        if not k:
            continue
        assert (k["namespace"], k["service_account"]) in accounts, f"pool {pool['name']}: no ServiceAccount {k}"
        assert k["namespace"] in policies, f"pool {pool['name']}: its trainers have no NetworkPolicy"
        for volume in k.get("volumes", []):
            claim = volume["source"].get("persistent_volume_claim")
            if claim:
                assert (k["namespace"], claim["claim_name"]) in claims, f"pool {pool['name']}: no PVC {claim}"


def test_the_trainer_network_policy_selects_the_pods_the_dispatcher_labels(rendered) -> None:
    source = (REPO_ROOT / "dispatcher" / "src" / "kubernetes" / "mod.rs").read_text()
    constant = lambda name: re.search(rf'pub const {name}: &str = "([^"]+)"', source).group(1)  # noqa: E731
    labels = {constant("LABEL_MANAGED_BY"): constant("MANAGED_BY"), constant("LABEL_NAME"): constant("TRAINER_APP")}
    policy = find(rendered["xeon"], "NetworkPolicy", "tuneq-trainers")
    assert policy["spec"]["podSelector"]["matchLabels"] == labels
    assert policy["spec"]["ingress"] == []
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
