"""deploy/kustomize is generated from the chart (scripts/generate-kustomize) and does not
drift: the committed files are what the generator writes now, and `kubectl kustomize`
(kustomize built into kubectl) of the base and of each overlay gives exactly the chart's
render with the matching values file; and each passes `kubernetes-validate --strict`."""

from __future__ import annotations

import subprocess

import pytest
import yaml

import tuneq_chart
from conftest import venv_tool
from test_chart import kubernetes_validate


def test_the_committed_tree_is_what_the_generator_writes() -> None:
    want = tuneq_chart.generate()
    have = tuneq_chart.committed()
    stale = sorted(set(have) - set(want))
    missing = sorted(set(want) - set(have))
    changed = sorted(p for p in set(want) & set(have) if want[p] != have[p])
    assert not (stale or missing or changed), (
        f"deploy/kustomize drifted from the chart: stale {stale}, missing {missing}, changed {changed}; "
        "run scripts/generate-kustomize and commit the result")


@pytest.mark.parametrize("overlay,values", [("base", tuneq_chart.BASE_VALUES)] +
                         [(f"overlays/{o}", v) for o, v in tuneq_chart.OVERLAYS.items()])
def test_kustomize_builds_exactly_the_charts_render(overlay, values) -> None:
    built = subprocess.run([venv_tool("kubectl"), "kustomize", str(tuneq_chart.KUSTOMIZE / overlay)],
                           capture_output=True, text=True, check=True).stdout
    got = {tuneq_chart.key(o): o for o in yaml.safe_load_all(built) if o}
    want = {tuneq_chart.key(o): tuneq_chart.for_kustomize(o) for o in tuneq_chart.render_objects([values])}
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == want[k], f"{overlay}: {k} differs from the chart's render"


@pytest.mark.parametrize("overlay", ["base"] + [f"overlays/{o}" for o in tuneq_chart.OVERLAYS])
def test_every_kustomize_overlay_builds_and_passes_strict_schema_validation(overlay: str) -> None:
    built = subprocess.run([venv_tool("kubectl"), "kustomize", str(tuneq_chart.KUSTOMIZE / overlay)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    objs = [o for o in yaml.safe_load_all(built.stdout) if o]
    assert objs
    result = kubernetes_validate(objs)
    assert result.returncode == 0, result.stdout + result.stderr
