"""The chart lints and renders for every values set; its schema refuses typos; every
rendered manifest passes `kubernetes-validate --strict` against the Kubernetes version
we target (unknown fields refused)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

import tuneq_chart
from conftest import CASES, venv_tool

K8S = tuneq_chart.K8S_VERSION
# Kinds with no schema in kubernetes-validate (CRDs); checked by the policy tests instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def kubernetes_validate(objs: list[dict]) -> subprocess.CompletedProcess:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump_all(objs, f, sort_keys=False)
        path = f.name
    try:
        return subprocess.run([venv_tool("kubernetes-validate"), "--strict", "-k", K8S, "--quiet", path],
                              capture_output=True, text=True)
    finally:
        Path(path).unlink()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_chart_lints_strictly(case: str) -> None:
    report = tuneq_chart.lint(tuneq_chart.load_values(CASES[case]))
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rendered_manifest_passes_strict_schema_validation(case: str, rendered) -> None:
    objs = [o for o in rendered[case] if (o["apiVersion"], o["kind"]) not in CRD_KINDS]
    result = kubernetes_validate(objs)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_validator_refuses_a_misspelt_field(rendered) -> None:
    """A validator that passes everything would prove nothing."""
    deployment = next(o for o in rendered["xeon"] if o["kind"] == "Deployment")
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30
    assert kubernetes_validate([bad]).returncode != 0


@pytest.mark.parametrize("override,complaint", [
    ({"api": {"replica": 3}}, "replica"),                          # a misspelt key
    ({"image": {"tag": "latest"}}, "/image/tag"),                  # latest is refused
    ({"store": {"uri": "file:///srv/tuneq"}}, "/store/uri"),       # pods share no folder
    ({"redis": {"mode": "embedded"}}, "/redis/mode"),
    ({"api": {"resources": {"limits": None}}}, "limits"),          # null drops a default
    ({"dispatcher": {"readNodes": "yes"}}, "/dispatcher/readNodes"),
])
def test_the_schema_refuses_bad_values(override: dict, complaint: str) -> None:
    import helm_python

    values = tuneq_chart.merge(tuneq_chart.load_values(CASES["xeon"]), override)
    with pytest.raises(helm_python.HelmValuesError) as refused:
        tuneq_chart.render(values)
    assert complaint in str(refused.value), str(refused.value)


def test_required_values_are_named_when_missing() -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError) as refused:
        tuneq_chart.render({})
    message = str(refused.value)
    for field in ("image", "secrets", "store"):
        assert field in message, message
