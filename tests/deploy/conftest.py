"""Shared fixtures of the deploy tests (scripts/validate-deploy runs them): the chart
rendered offline for each values set, and the tools the test venv brings."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "deploy" / "tools"))

import tuneq_chart  # noqa: E402

CHART = tuneq_chart.CHART
# The values sets every check runs on: the two shipped values files, every optional
# part switched on, and the Kustomize base.
CASES = {
    "gke-spot-l4": [CHART / "values-gke-spot-l4.yaml"],
    "xeon": [CHART / "values-xeon.yaml"],
    "everything": [REPO_ROOT / "tests" / "deploy" / "values-everything.yaml"],
    "kustomize-base": [tuneq_chart.BASE_VALUES],
}


def venv_tool(name: str) -> str:
    """A console script of the interpreter running the tests (the test venv), else PATH's."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; scripts/setup-test-deps installs it into .venv "
                    "from tests/servers-requirements.txt", pytrace=False)
    return found


def tuneq_bin() -> Path:
    raw = os.environ.get("TUNEQ_BIN", "target/debug/tuneq")
    path = Path(raw) if os.path.isabs(raw) else REPO_ROOT / raw
    if not os.access(path, os.X_OK):
        pytest.fail(f"tuneq binary not found at {path} (TUNEQ_BIN={raw!r}); build it with "
                    "`cargo build`.", pytrace=False)
    return path


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """Case name -> the chart's objects rendered with that case's values."""
    return {case: tuneq_chart.render_objects(files) for case, files in CASES.items()}


def find(objs: list[dict], kind: str, name: str) -> dict:
    for obj in objs:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind} {name} in the render")


def pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    if obj["kind"] == "Pod":
        return obj["spec"]
    return None
