"""The README's walk-through, run as written: its shell block (the only change: the URL
of this test's `tuneq up`) uploads a dataset, starts a fine-tune of the demo model,
watches its server-sent events until it ends, and downloads the adapter, which PEFT
then loads on the base model. If the README and the service drift apart, this fails."""

from __future__ import annotations

import os
import re
import subprocess

from conftest import REPO_ROOT, Service


def walkthrough() -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    match = re.search(r"The walk-through \(a second terminal.*?```sh\n(.*?)```", readme, re.S)
    assert match, "README.md lost its walk-through block"
    return match.group(1)


def test_the_readme_walkthrough_works_as_written(tmp_path):
    script = walkthrough()
    assert "URL=http://127.0.0.1:8080" in script
    service = Service(tmp_path / "work" / ".tuneq" / "data")
    try:
        work = tmp_path / "work"
        (work / "examples").symlink_to(REPO_ROOT / "examples")
        script = script.replace("URL=http://127.0.0.1:8080", f"URL={service.url}")
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work,
                                capture_output=True, text=True, timeout=600,
                                env={**os.environ, "LC_ALL": "C.UTF-8"})
        assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
        # The stream ended with the job, succeeded.
        done = [line for line in result.stdout.splitlines() if line.startswith("event: done")]
        assert done, result.stdout[-3000:]
        assert '"status":"succeeded"' in result.stdout.split("event: done", 1)[1]
        assert (work / "adapter_config.json").is_file()
        assert (work / "adapter_model.safetensors").is_file()

        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(service.data_dir / "models" / "tuneq-tiny-demo",
                                                    torch_dtype=torch.float32)
        tuned = PeftModel.from_pretrained(base, work)
        with torch.no_grad():
            logits = tuned(torch.tensor([[1, 2, 3]])).logits
        assert torch.isfinite(logits).all()
    finally:
        service.stop()
