"""The Dockerfile installs raychat as the Makefile does: the same pip commands (expanded by `make -n` and by
the shell of a RUN line, for the same TORCH_SPEC / TORCH_INDEX / EXTRAS), the same constraints.txt and torch
pin, on the rayproject/ray GPU image of the pinned Ray and Python; k8s/ and ray_cluster.yaml name that image.
(The image itself is not built here: no Docker daemon.)"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from raychat.ops import k8s

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()
# a shell function that prints its arguments, one per line after a "pip" line: what a pip line would run
PRINT_PIP = 'pip() { echo "<pip>"; for a in "$@"; do echo "$a"; done; }; '


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each Dockerfile instruction, continuation lines joined, comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def dockerfile_args() -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in instructions(DOCKERFILE) if op == "ARG")


def argv_lists(script: str, env: dict[str, str]) -> list[list[str]]:
    """The argument lists of the `pip` commands of a shell script, each expanded by sh with `env`."""
    out = subprocess.run(
        ["sh", "-c", PRINT_PIP + script], env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    calls = out.split("<pip>\n")[1:]
    return [["pip", *c.splitlines()] for c in calls]


def docker_pip(values: dict[str, str]) -> list[list[str]]:
    """The pip commands of the Dockerfile's RUN lines with the build args `values` (ARG defaults otherwise)."""
    env = {**dockerfile_args(), **values}
    runs = [a for op, a in instructions(DOCKERFILE) if op == "RUN"]
    steps = [s.strip() for run in runs for s in run.split("&&") if s.strip().startswith("pip ")]
    return argv_lists("\n".join(steps), env)


def make_pip(values: dict[str, str]) -> list[list[str]]:
    """The pip commands `make venv` runs with the variables `values` (printed by `make -n`, run nowhere)."""
    assigns = [f"{k}={v}" for k, v in values.items()]
    out = subprocess.run(
        ["make", "-n", "-B", "venv", "PIP=pip", "VENV=/nonexistent/venv", *assigns],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return argv_lists("\n".join(line for line in out.splitlines() if line.startswith("pip ")), {})


@pytest.mark.parametrize(
    "values",
    [
        {"TORCH_SPEC": "torch==2.13.0", "TORCH_INDEX": "", "EXTRAS": "tracking"},
        {
            "TORCH_SPEC": "torch==2.13.0",
            "TORCH_INDEX": "https://download.pytorch.org/whl/cu128",
            "EXTRAS": "k8s",
        },
        {  # the vLLM image (raychat-vllm): the vLLM environment and its own lock
            "TORCH_SPEC": "torch==2.13.0",
            "TORCH_INDEX": "https://download.pytorch.org/whl/cu128",
            "EXTRAS": "vllm",
            "CONSTRAINTS": "constraints-vllm.txt",
        },
    ],
)
def test_the_image_installs_raychat_as_the_makefile_does(values):
    docker = docker_pip(values)
    assert docker == make_pip(values)
    # what that is: pip upgraded, torch alone first (from the index when given), then the project with the
    # constraints file
    index = ["--index-url", values["TORCH_INDEX"]] if values["TORCH_INDEX"] else []
    assert docker == [
        ["pip", "install", "-q", "--upgrade", "pip>=24"],
        ["pip", "install", "-q", values["TORCH_SPEC"], *index],
        [
            "pip",
            "install",
            "-q",
            "-c",
            values.get("CONSTRAINTS", "constraints.txt"),
            "-e",
            f".[{values['EXTRAS']}]",
        ],
    ]


def test_the_defaults_agree_and_pin_torch():
    make_defaults = dict(re.findall(r"^(\w+) \?= ?(.*)$", (REPO / "Makefile").read_text(), re.M))
    args = dockerfile_args()
    assert args["TORCH_SPEC"] == make_defaults["TORCH_SPEC"] == "torch==2.13.0"  # FACTS.md: pin torch
    assert args["TORCH_INDEX"] == make_defaults["TORCH_INDEX"] == ""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (torch_range,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "torch"]
    assert torch_range.specifier.contains(args["TORCH_SPEC"].split("==")[1])
    assert args["EXTRAS"] in project["optional-dependencies"]
    assert args["CONSTRAINTS"] == make_defaults["CONSTRAINTS"] == "constraints.txt"
    # constraints.txt leaves torch to that pin (make lock drops it) and pins Ray
    constraints = (REPO / "constraints.txt").read_text().splitlines()
    assert not [c for c in constraints if c.startswith("torch==")]
    assert "ray==2.60.0" in constraints


def test_the_image_is_the_pinned_ray_gpu_image_with_the_checkout_at_the_app_dir():
    ops = instructions(DOCKERFILE)
    (base,) = [a for op, a in ops if op == "FROM"]
    assert base == "${RAY_IMAGE}"
    ray = next(c for c in (REPO / "constraints.txt").read_text().splitlines() if c.startswith("ray=="))
    assert dockerfile_args()["RAY_IMAGE"] == f"rayproject/ray:{ray.split('==')[1]}-py311-gpu"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert SpecifierSet(project["requires-python"]).contains("3.11")  # py311: a Python raychat supports
    assert [a for op, a in ops if op == "WORKDIR"] == [k8s.APP_DIR]  # the RayJobs' working_dir
    copied = [w for op, a in ops if op == "COPY" for w in shlex.split(a)[1:-1]]
    # what `pip install -e .` reads (pyproject's readme, the constraints, the package), what jobs run
    assert copied == ["pyproject.toml", "constraints.txt", "constraints-vllm.txt", "README.md", "platform", "jobs", "serve"]  # fmt: skip
    copy_before_install = [op for op, a in ops if op in ("COPY", "RUN")]
    assert copy_before_install.index("COPY") < max(
        i for i, op in enumerate(copy_before_install) if op == "RUN"
    )


def test_k8s_and_the_launcher_name_the_image_the_dockerfile_documents():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert k8s.IMAGE == f"raychat:{version}"
    assert f"docker build -t {k8s.IMAGE} ." in DOCKERFILE
    overlay = yaml.safe_load((REPO / "k8s/overlays/gpu/kustomization.yaml").read_text())
    (image,) = [i for i in overlay["images"] if i["name"] == "raychat"]
    pushed = f"{image['newName']}:{image['newTag']}"
    assert (image["name"], image["newTag"]) == ("raychat", version)
    assert f"docker push {pushed}" in DOCKERFILE
    launcher = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    assert launcher["docker"]["image"] == pushed
    # the vLLM RayService's image: the same Dockerfile with the vLLM environment's build args
    build = "docker build --build-arg EXTRAS=vllm --build-arg CONSTRAINTS=constraints-vllm.txt"
    assert (
        f"{build} --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t {k8s.IMAGE_VLLM} ."
        in DOCKERFILE
    )
    assert (REPO / "constraints-vllm.txt").is_file()
    vllm = next(i for i in overlay["images"] if i["name"] == k8s.IMAGE_VLLM.split(":")[0])
    assert f"docker push {vllm['newName']}:{vllm['newTag']}" in DOCKERFILE and vllm["newTag"] == version
