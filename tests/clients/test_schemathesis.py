"""schemathesis fuzzes every operation of the committed `openapi/openapi.json` against a
real `tuneq up`: no 5xx, every response (status, content type, headers, body) as the
document declares, schema-violating requests refused with 4xx, unknown methods 405.

`positive_data_acceptance` is left out on purpose: a request can match the schema and
still be refused for what it means (an unknown model, a file that does not exist), and
that refusal is the documented 400."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT, Service


def test_every_operation_conforms_to_the_document(tmp_path: Path):
    service = Service(tmp_path / "data")
    try:
        cli = Path(sys.executable).with_name("schemathesis")
        result = subprocess.run(
            [str(cli), "run", str(REPO_ROOT / "openapi/openapi.json"),
             "--url", service.url,
             "--header", f"Authorization: Bearer {service.api_key}",
             "--checks", "all", "--exclude-checks", "positive_data_acceptance",
             "--max-examples", os.environ.get("TUNEQ_SCHEMATHESIS_EXAMPLES", "20"),
             "--max-time", os.environ.get("TUNEQ_SCHEMATHESIS_SECONDS", "90"),
             "--seed", "1", "--report-dir", str(tmp_path / "report")],
            capture_output=True, text=True, timeout=600,
        )
        assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
        assert "passed" in result.stdout
    finally:
        service.stop()
