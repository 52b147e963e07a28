"""The files an operator deploys with (``infra/container/Dockerfile``,
``infra/kubernetes/``, ``requirements-cuda.lock``) agree with the code they run: no
cluster or image build here, only what can drift when the code changes."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from flows import hosts

ROOT = Path(__file__).resolve().parents[1]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_the_image_holds_every_package_and_both_locks():
    """Every package pyproject.toml installs is copied into the image (a package added
    to the project and left out of the image would fail only in the cluster), from the
    lock, with the CUDA lock for ``ACCELERATOR=cuda``."""
    dockerfile = (ROOT / "infra/container/Dockerfile").read_text()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile, re.M))
    assert copied == set(packages), (copied, packages)
    assert "pip install -r requirements.lock" in dockerfile
    assert "pip install -r requirements-cuda.lock" in dockerfile


def test_the_cuda_lock_pins_the_plugin_of_the_locked_jax():
    """``requirements-cuda.lock`` adds JAX's CUDA 12 plugin of exactly the jax that
    ``requirements.lock`` pins (a plugin of another version refuses to load), and
    changes no pin of the CPU lock."""
    cpu, cuda = _pins(ROOT / "requirements.lock"), _pins(ROOT / "requirements-cuda.lock")
    jax = cpu["jax"]
    assert cuda["jax-cuda12-plugin"] == cuda["jax-cuda12-pjrt"] == jax
    assert {n: v for n, v in cuda.items() if n in cpu and cpu[n] != v} == {}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["cuda"] == [f"jax[cuda12]=={jax}"]


def test_the_kubernetes_learner_job_sets_what_its_processes_read():
    """The indexed Job of a learner over N pods: the variables it sets are the ones
    ``flows.hosts`` reads, its pod count is the process count, the coordinator's port is
    the one the pods and the headless Service open, the Service selects the Job's pods,
    pod 0 runs the flow run and the others follow it (``python -m flows.worker follow``)."""
    template = yaml.safe_load((ROOT / "infra/kubernetes/learner-job.yaml").read_text())
    service = yaml.safe_load((ROOT / "infra/kubernetes/learner-service.yaml").read_text())
    assert set(template) == {"job_configuration", "variables"}  # a base job template
    job = template["job_configuration"]["job_manifest"]["spec"]
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    pod = job["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env[hosts.PROCESS_COUNT_ENV]) == job["completions"] == job["parallelism"]
    host, port = env[hosts.COORDINATOR_ENV].split(":")
    assert host == f"$(JOB_NAME)-0.{pod['spec']['subdomain']}"
    assert service["metadata"]["name"] == pod["spec"]["subdomain"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ports = {int(port), container["ports"][0]["containerPort"], service["spec"]["ports"][0]["port"]}
    assert len(ports) == 1
    dockerfile = (ROOT / "infra/container/Dockerfile").read_text()
    assert f"EXPOSE {port}" in dockerfile
    command = container["command"][-1]
    assert f'"${hosts.INDEXED_JOB_ENV}" = 0' in command
    assert "exec prefect flow-run execute" in command and "python -m flows.worker follow" in command
