"""The Dockerfiles follow the rules of issue 13: a multi-stage build of the one `tuneq`
binary, the final stage on a slim Debian (CPU) or NVIDIA CUDA runtime (GPU) base, no
build tools there, a non-root numeric user matching the trainer uid the dispatcher's
Jobs run as, OCI labels, exec-form entrypoint `tuneq`, no HEALTHCHECK, every base image
pinned. (hadolint, at the warning threshold, runs in scripts/validate-deploy.)"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO_ROOT

DOCKER = REPO_ROOT / "deploy" / "docker"
TRAINER_UID = "10001"   # dispatcher/src/kubernetes/job.rs TRAINER_UID
BUILD_TOOLS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|cmake|pkg-config|libssl-dev|"
                         r"cargo|rustc|rustup|nvcc|cuda-toolkit|git|curl|wget)\b")
OCI_LABELS = ["title", "description", "source", "licenses", "version", "revision"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        current += " " + stripped.rstrip("\\").strip() if current else stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            word, _, rest = current.partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def arg_defaults(path: Path) -> dict[str, str]:
    defaults = {}
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            defaults[k] = v.strip('"')
    return defaults


def resolve(image: str, defaults: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults[m.group(1) or m.group(2)], image)


@pytest.mark.parametrize("name,runtime_base", [
    ("Dockerfile", re.compile(r"^debian:[a-z]+-\d{8}-slim$")),
    ("Dockerfile.cuda", re.compile(r"^nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+$")),
])
def test_dockerfile_rules(name: str, runtime_base: re.Pattern) -> None:
    path = DOCKER / name
    defaults = arg_defaults(path)
    all_stages = stages(path)
    assert len(all_stages) >= 2, f"{name}: a multi-stage build (builder, then runtime)"

    for stage in all_stages:
        image = resolve(stage[0][1].split()[0], defaults)
        if image in {s[0][1].split()[-1] for s in all_stages if " AS " in s[0][1].upper()}:
            continue  # FROM an earlier stage
        assert ":" in image and not image.endswith(":latest"), f"{name}: {image} must be pinned"

    final = all_stages[-1]
    base = resolve(final[0][1].split()[0], defaults)
    assert runtime_base.match(base), f"{name}: the runtime stage's base is {base}"
    words = [w for w, _ in final]
    assert "HEALTHCHECK" not in [w for w, _ in instructions(path)], \
        f"{name}: no HEALTHCHECK (Kubernetes probes /readyz and /healthz)"

    for word, rest in final:
        if word == "RUN":
            assert not BUILD_TOOLS.search(rest), f"{name}: build tools in the final stage: {rest}"
        if word == "COPY":
            assert rest.startswith("--from="), f"{name}: the final stage copies only built artefacts: COPY {rest}"

    users = [rest for w, rest in final if w == "USER"]
    assert users, f"{name}: the final stage sets USER"
    assert users[-1].split(":")[0] == TRAINER_UID, \
        f"{name}: USER {users[-1]}, the trainer uid the dispatcher runs pods as is {TRAINER_UID}"

    entry = [rest for w, rest in final if w == "ENTRYPOINT"]
    assert entry and entry[-1].startswith("["), f"{name}: an exec-form ENTRYPOINT"
    assert Path(json.loads(entry[-1])[0]).name == "tuneq", f"{name}: the entrypoint is tuneq"
    copied = [rest for w, rest in final if w == "COPY"]
    assert any(shlex.split(c)[-1] == json.loads(entry[-1])[0] for c in copied), \
        f"{name}: the entrypoint is the binary copied from the build stage"

    labels = " ".join(rest for w, rest in final if w == "LABEL")
    for label in OCI_LABELS:
        assert f"org.opencontainers.image.{label}=" in labels, f"{name}: OCI label {label}"
    assert "--locked" in " ".join(rest for w, rest in instructions(path) if w == "RUN"), \
        f"{name}: cargo build --locked (Cargo.lock's versions)"
    if name.endswith(".cuda"):
        assert "--features cuda" in " ".join(rest for w, rest in instructions(path) if w == "RUN")
    assert "USER" in words


def test_dockerignore_keeps_the_context_small_and_secret_free() -> None:
    ignored = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for must in ("target", ".git", ".venv", ".env*"):
        assert must in ignored, f".dockerignore leaves out {must}"
