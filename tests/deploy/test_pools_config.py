"""The pools file each values set puts in its ConfigMap is one tuneq accepts:
`tuneq dispatcher --check-config FILE` (tuneq's own parser: unknown fields refused,
`latest` images refused, every field checked) exits 0 and lists every pool."""

from __future__ import annotations

import subprocess
import tomllib

import pytest

from conftest import CASES, find, tuneq_bin


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pools_configmap_passes_tuneqs_own_check(case, rendered, tmp_path) -> None:
    text = find(rendered[case], "ConfigMap", "tuneq-pools")["data"]["pools.toml"]
    path = tmp_path / "pools.toml"
    path.write_text(text)
    result = subprocess.run([str(tuneq_bin()), "dispatcher", "--check-config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    for pool in tomllib.loads(text)["pool"]:
        assert pool["name"] in result.stdout


def test_a_bad_pools_file_is_refused(rendered, tmp_path) -> None:
    """The check is real: a misspelt field in the chart's pools file fails it."""
    text = find(rendered["xeon"], "ConfigMap", "tuneq-pools")["data"]["pools.toml"]
    path = tmp_path / "pools.toml"
    path.write_text(text.replace("tolerations =", "toleration ="))
    result = subprocess.run([str(tuneq_bin()), "dispatcher", "--check-config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "toleration" in result.stdout + result.stderr
