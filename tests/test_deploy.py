"""Prefect-native launch: prefect.yaml's deployments, its pull steps, and a run started
from the `train` deployment on real process workers (the session's Prefect server).

- `prefect deploy --all` makes a `train` deployment whose parameters match the launcher's
  signature, and `prefect deployment run 'train/us-east' --param ...` starts a run;
  job variables hold no credentials;
- the pull steps: credentials from a Secret block into the flow run's environment; a
  git clone of the project imported from the clone;
- a run started from the `train` deployment, its workers flow runs of the regions'
  deployments: the launcher's flow run is tagged with the run, and every learner and
  syncer flow run it started is its subflow. The S3 bucket's credentials reach the flow
  runs only through a Secret block.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import yaml

from tests.prefect_runs import subflow_of

REPO = Path(__file__).resolve().parents[1]
POOLS = ("us-east", "eu-west")
SECRET_BLOCK = "diloco-test-s3"
S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


def _prefect(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefect", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


@pytest.fixture(scope="module")
def deployed(prefect_api, tmp_path_factory):
    """prefect.yaml deployed as `python -m infra.local_stack up` does: a process work pool
    per region, then `prefect deploy --all`. Returns the environment it used."""
    home = tmp_path_factory.mktemp("deployed")
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "DILOCO_DIR": str(home),
           "DILOCO_BUCKET_US_EAST": f"file://{home}/us", "DILOCO_BUCKET_EU_WEST": f"file://{home}/eu"}  # fmt: skip
    for pool in POOLS:
        _prefect("work-pool", "create", pool, "--type", "process", "--overwrite", env=env)
    out = _prefect("--no-prompt", "deploy", "--all", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return env


def test_prefect_yaml_deploys_a_train_deployment_that_starts_a_run(deployed):
    """Every deployment names a flow by module path (no checkout path assumed), with
    parameters its flow takes; `train/us-east` starts a run from the command line, with a
    wrong launch mode refused before anything runs; no job variable holds a credential."""
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    with _client() as client:
        found = {
            f"{client.read_flow(d.flow_id).name}/{d.name}": d for d in client.read_deployments()
        }
    expected = {f"{role}/{pool}" for role in ("learner", "syncer", "join") for pool in POOLS}
    assert expected | {"train/us-east"} <= set(found)
    for entry in spec["deployments"]:
        flow = load_flow_from_entrypoint(entry["entrypoint"])
        assert ":" not in entry["entrypoint"], entry  # a module path, imported as installed
        deployment = found[f"{flow.name}/{entry['name']}"]
        assert deployment.entrypoint == entry["entrypoint"]
        signature = inspect.signature(flow.fn).parameters
        assert set(deployment.parameters) <= set(signature), (entry, deployment.parameters)
        assert deployment.pull_steps == spec["pull"]
        variables = json.dumps(deployment.job_variables or {})
        assert not any(word in variables for word in ("AWS_", "GOOGLE_", "SECRET", "KEY")), (
            variables
        )
    train = found["train/us-east"]
    required = [n for n, p in inspect.signature(load_flow_from_entrypoint(train.entrypoint).fn)
                .parameters.items() if p.default is inspect.Parameter.empty]  # fmt: skip
    assert set(required) <= set(train.parameters), required  # runnable from the UI as is
    assert train.parameter_openapi_schema["properties"]["via"]["enum"] == [
        "processes",
        "deployments",
    ]
    assert "launcher" in train.tags

    run = f"cli-{uuid.uuid4().hex[:6]}"
    out = _prefect("deployment", "run", "train/us-east", "--param", f"run={run}",
                   "--param", "via=processes", "--param", 'overrides=["budget.tokens=1000"]',
                   env=deployed)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    flow_run_id = out.stdout.split("UUID: ")[1].split()[0]
    with _client() as client:
        flow_run = client.read_flow_run(uuid.UUID(flow_run_id))
        assert flow_run.deployment_id == train.id
        assert flow_run.parameters["run"] == run and flow_run.parameters["via"] == "processes"
        assert flow_run.parameters["overrides"] == ["budget.tokens=1000"]
        assert flow_run.parameters["regions"] == train.parameters["regions"]
        client.delete_flow_run(flow_run.id)  # no worker in this test: never started
    out = _prefect("deployment", "run", "train/us-east", "--param", "via=boats", env=deployed)
    assert out.returncode != 0 and "'boats' is not one of" in out.stdout + out.stderr
    # The whole config is one parameter, its fields described (the UI's form for it), and
    # checked once, field by field, before anything runs.
    fields = train.parameter_openapi_schema["definitions"]
    assert "tau steps after sending" in fields["TopologyConfig"]["properties"]["tau"]["description"]
    out = _prefect("deployment", "run", "train/us-east", "--param", f"run={run}-2",
                   "--param", 'config={"topology": {"tau": "soon"}}', env=deployed)  # fmt: skip
    assert out.returncode != 0 and "'soon' is not of type 'integer'" in out.stdout + out.stderr


def test_a_crashed_launcher_is_run_again_with_its_parameters(deployed):
    """Issue 57: the automations ``infra.automations`` installs (the local stack does, at
    ``up``) are on the server once, however often installed; a launcher flow run that
    ends Crashed (its machine died) is run again from its deployment with its own
    parameters, after its lease on the run has gone stale. (No worker here: the new flow
    run is read and removed, never started.)"""
    from prefect.automations import Automation

    from infra import automations

    names = {a.name for a in (automations.zombies(), automations.resume_launchers())}
    assert set(automations.install()) <= names
    assert automations.install() == []  # there already
    try:
        _crashed_launcher_runs_again(deployed)
    finally:  # the other tests' launchers are theirs to restart
        for name in names:
            Automation.read(name=name).delete()


def _crashed_launcher_runs_again(deployed: dict[str, str]) -> None:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.states import Crashed

    from infra import automations

    run = f"crash-{uuid.uuid4().hex[:6]}"
    out = _prefect("deployment", "run", "train/us-east", "--param", f"run={run}",
                   "--param", 'overrides=["budget.tokens=1000"]', env=deployed)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    first = uuid.UUID(out.stdout.split("UUID: ")[1].split()[0])
    with _client() as client:
        crashed = client.read_flow_run(first)
        client.set_flow_run_state(first, Crashed(message="its machine died (a test)"), force=True)
        died = client.read_flow_run(first).state.timestamp
        ids = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[crashed.deployment_id]))
        again = None
        for _ in range(1800):  # the trigger service acts within seconds; a guard, not a measure
            again = next((f for f in client.read_flow_runs(flow_run_filter=ids)
                          if f.id != first and f.parameters.get("run") == run), None)  # fmt: skip
            if again is not None:
                break
            time.sleep(0.1)
        assert again is not None, "the crashed launcher was not run again"
        for name in ("run", "regions", "via", "preset", "overrides"):
            assert again.parameters[name] == crashed.parameters[name], name
        assert again.state.name == "Scheduled"
        # after the crash, not after the automation acted (seconds later on a busy machine)
        lag = again.state.state_details.scheduled_time - died
        assert lag.total_seconds() >= automations.RESUME_AFTER.total_seconds() - 1
        for f in (first, again.id):
            client.delete_flow_run(f)


def test_credentials_come_from_a_secret_block(deployed, monkeypatch, tmp_path):
    """The deployments' pull step puts the variables of the Secret block that
    DILOCO_CREDENTIALS_BLOCK names into the flow run's environment (a service account key
    into a private file); its output names them, never their values. None named: nothing."""
    from prefect.blocks.system import Secret
    from prefect.deployments.steps.core import StepExecutionError, run_steps

    with _client() as client:
        steps = client.read_deployment_by_name("learner/us-east").pull_steps
    monkeypatch.delenv("DILOCO_CREDENTIALS_BLOCK", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    assert asyncio.run(run_steps(steps)) == {"credentials": ""}
    assert "AWS_SECRET_ACCESS_KEY" not in os.environ
    key = {"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----"}
    Secret(value={"AWS_SECRET_ACCESS_KEY": "s3cr3t-value", "GOOGLE_APPLICATION_CREDENTIALS": key}
           ).save("diloco-test-creds", overwrite=True)  # fmt: skip
    monkeypatch.setenv("DILOCO_CREDENTIALS_BLOCK", "diloco-test-creds")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nowhere")  # the block wins
    output = asyncio.run(run_steps(steps))
    try:
        assert output == {"credentials": "AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS"}
        assert os.environ["AWS_SECRET_ACCESS_KEY"] == "s3cr3t-value"
        path = Path(os.environ["GOOGLE_APPLICATION_CREDENTIALS"])
        assert json.loads(path.read_text()) == key
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "/nowhere") != "/nowhere":
            Path(os.environ["GOOGLE_APPLICATION_CREDENTIALS"]).unlink(missing_ok=True)
    Secret(value="not an object").save("diloco-test-bad", overwrite=True)
    monkeypatch.setenv("DILOCO_CREDENTIALS_BLOCK", "diloco-test-bad")
    with pytest.raises(StepExecutionError) as err:
        asyncio.run(run_steps(steps))
    assert "'diloco-test-bad' must hold a JSON object" in str(err.value.__cause__)


def test_the_git_pull_steps_import_the_project_from_its_clone(tmp_path):
    """`pull: *git` (prefect.yaml): a flow run clones DILOCO_GIT_URL at DILOCO_GIT_REF,
    checks the locked dependencies and imports the project from the clone for the rest of
    its life, its child processes included, whatever else is installed."""
    source = tmp_path / "source"
    for part in ("flows", "diloco", "storage_layout", "infra"):
        shutil.copytree(REPO / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "requirements.lock", "prefect.yaml"):
        shutil.copy(REPO / name, source / name)
    (source / "flows" / "marker.py").write_text("WHERE = 'the clone'\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", str(source)], check=True)
    subprocess.run([*git, "-C", str(source), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(source), "commit", "-qm", "x"], check=True)
    subprocess.run([*git, "-C", str(source), "branch", "-q", "release"], check=True)
    script = (
        "import asyncio, os, subprocess, sys, yaml\n"
        "from prefect.deployments.steps.core import run_steps\n"
        "steps = yaml.safe_load(open(sys.argv[1]))['definitions']['pull']['git']\n"
        "out = asyncio.run(run_steps(steps))\n"
        "import flows.marker, flows.deploy\n"
        "child = subprocess.run([sys.executable, '-c', 'import flows.marker as m; print(m.__file__)'],\n"
        "                       capture_output=True, text=True, cwd='/')\n"
        "print(out['directory'], os.getcwd(), flows.deploy.__file__, child.stdout.strip(),\n"
        "      sep='\\n')\n"
    )
    work = tmp_path / "flow-run"  # a process worker's flow run starts in an empty folder
    work.mkdir()
    env = {**os.environ, "DILOCO_GIT_URL": f"file://{source}", "DILOCO_GIT_REF": "release"}
    env.pop("DILOCO_CREDENTIALS_BLOCK", None)
    out = subprocess.run([sys.executable, "-c", script, str(REPO / "prefect.yaml")], cwd=work,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    directory, cwd, deploy_file, child = out.stdout.strip().splitlines()[-4:]
    clone = work / "source-release"
    assert Path(directory) == clone.resolve() and Path(cwd) == clone.resolve()
    assert Path(deploy_file).is_relative_to(clone.resolve()), deploy_file
    assert Path(child).is_relative_to(clone.resolve()), child


def test_a_launcher_adopts_the_flow_runs_an_earlier_one_left_going(deployed, monkeypatch):
    """A launcher of deployments that died (not stopped) left its workers' flow runs going
    in their regions; the next launcher of the run adopts each (one still scheduled,
    pending or running, of the worker's deployment and identity) and waits on it rather
    than start a second: the learner flow runs the run had are all it gets. One that
    ended, one of another worker, and one of another run are not adopted. (No work pool
    has a worker in this test: the flow runs stay scheduled.)"""
    from prefect import flow
    from prefect.deployments import run_deployment
    from prefect.states import Cancelled, Completed

    from diloco.config import load_config
    from flows import launch_deployments, workers
    from flows.run import initialize_run
    from storage_layout.store import RunStore

    root = Path(deployed["DILOCO_DIR"]) / "adopt"
    (root / "us").mkdir(parents=True)
    regions = {"us-east": f"file://{root / 'us'}"}
    run = f"adopt-{uuid.uuid4().hex[:6]}"
    cfg = load_config("tiny", overrides=["topology.learners=2", "budget.tokens=20000"])
    initialize_run(RunStore(run, regions, "us-east"), cfg)
    left = [workers.learner(run, regions["us-east"], "us-east", i, cfg) for i in (0, 1)]
    elsewhere = workers.learner("another-run", regions["us-east"], "us-east", 0, cfg)
    with _client() as client:
        runs = {w.name: run_deployment(w.deployment, parameters=w.params, tags=w.tags(w.params["run"]),
                                       timeout=0) for w in left}  # fmt: skip
        other = run_deployment(elsewhere.deployment, parameters=elsewhere.params,
                               tags=elsewhere.tags("another-run"), timeout=0)  # fmt: skip
        client.set_flow_run_state(runs["learner us-east/1"].id, Cancelled(), force=True)
        mode = launch_deployments.Deployments(run, regions, 2)
        assert mode.left_running(left[0].params).id == runs["learner us-east/0"].id
        assert mode.left_running(left[1].params) is None  # it ended
        syncer = workers.syncer(run, regions, 0, cfg)
        assert mode.left_running(syncer.params) is None  # no syncer was left going
        # The adopted one is watched to its end, not started again: once it completes and
        # the learner's status says done, the worker is over.
        started, found = [], []
        monkeypatch.setattr("prefect.deployments.run_deployment",
                            lambda *a, **k: started.append(a) or runs["learner us-east/0"])  # fmt: skip
        look = mode.left_running
        monkeypatch.setattr(mode, "left_running", lambda p: found.append(look(p)) or found[-1])
        RunStore(run, regions, "us-east").progress.write_metrics(
            "learner-0", {"state": "done", "step": 1}
        )

        @flow
        def launch() -> int:
            return mode.supervise.fn(left[0].name, left[0].deployment, left[0].params,
                                     left[0].tags(run), left[0].status)  # fmt: skip

        ended: list[int] = []
        watcher = threading.Thread(target=lambda: ended.append(launch()))
        watcher.start()
        deadline = time.monotonic() + 120  # a guard against a hang
        while not found and watcher.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found and found[0].id == runs["learner us-east/0"].id, found
        client.set_flow_run_state(found[0].id, Completed(), force=True)
        watcher.join(timeout=120)
        assert ended == [0] and started == [], (ended, started)
        assert look(left[0].params) is None  # (completed now)
        for flow_run in (*runs.values(), other):
            client.delete_flow_run(flow_run.id)


def test_a_flow_run_outlives_the_worker_that_reads_its_output(prefect_api, tmp_path):
    """Defect: when a Prefect process worker died, the pipe its flow runs wrote their
    output to broke; the next log line made Prefect's console handler (rich) end the flow
    run's process with SystemExit(1), and a learner, a syncer or the launcher itself died
    with its worker. Here a flow run (as learners, syncers and the launcher start) whose
    reader closes both pipes mid-run logs and prints on and completes; what it printed
    after the break is gone, its logs are not (the API has them)."""
    go, done = tmp_path / "go", tmp_path / "done"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from prefect import flow, get_run_logger\n"
        "from flows.observe import outlive_the_reader\n"
        "@flow\n"
        "def reader_dies():\n"
        "    outlive_the_reader()\n"
        "    get_run_logger().info('started')\n"
        "    print('ready', flush=True)\n"
        f"    while not Path({str(go)!r}).exists():\n"
        "        time.sleep(0.05)\n"
        "    for i in range(20):\n"
        "        get_run_logger().info('line %d after the reader died', i)\n"
        "        print('and a print', i, flush=True)\n"
        "        print('and an error line', i, file=sys.stderr, flush=True)\n"
        f"    Path({str(done)!r}).write_text('done')\n"
        "reader_dies()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=os.environ.copy())  # fmt: skip
    try:
        while (line := proc.stdout.readline()) and b"ready" not in line:
            pass
        assert line, "the flow run ended before it was ready"
        proc.stdout.close()  # the reader dies: both pipes break
        proc.stderr.close()
        go.touch()
        code = proc.wait(timeout=120)  # a guard against a hang
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0 and done.read_text() == "done", code


def test_a_linked_flow_run_is_named_before_its_worker_starts_it_and_crashed_if_it_dies(
    prefect_api,
):
    """Defects: a worker killed between creating its flow run and starting it left a
    Pending flow run with a random name ("crimson-caiman") that no one could place, and a
    worker killed mid-run left its flow run, and the round inside it, Running in the UI for
    ever. The flow run is named at creation, as the flow's ``flow_run_name`` names it at
    start; its supervisor sets it and its unfinished task runs Crashed, saying why, and
    leaves alone a flow run of the same name that another task run (a stand-by's)
    started."""
    from prefect import Task, flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from flows.learner import learner_flow
    from flows.observe import crash_linked, linked_flow_run, parent_env, worker_tags

    params = {"run": "r", "bucket": "file:///b", "region": "us-east", "index": 3,
              "pipeline": None, "continued": False}  # fmt: skip
    tags = worker_tags("r", "us-east", "learner:3")

    @task
    def start_a_worker(dies: bool):
        flow_run = linked_flow_run(learner_flow, params, parent_env(), tags)
        if not dies:
            return flow_run.id, 0, None
        with get_client(sync_client=True) as client:  # the round it was in when it died
            client.set_flow_run_state(flow_run.id, Running(), force=True)
            round_ = client.create_task_run(Task(fn=lambda: None, name="learner us-east/3 round 0"),
                                            flow_run.id, "0", state=Running())  # fmt: skip
        crashed = crash_linked(parent_env(), "learner us-east/3", "killed by signal 9")
        return flow_run.id, crashed, round_.id

    @flow
    def launcher():
        return start_a_worker(False), start_a_worker(True)

    (alive, none, _), (dead, crashed, round_) = launcher()
    with get_client(sync_client=True) as client:
        created, killed = client.read_flow_run(alive), client.read_flow_run(dead)
        task_run = client.read_task_run(round_)
        assert task_run.state.is_crashed() and task_run.state.message == "killed by signal 9"
        assert created.name == killed.name == "learner us-east/3", (created, killed)
        assert created.state.is_pending() and none == 0, created
        assert {"run:r", "region:us-east", "learner:3"} <= set(created.tags)
        assert crashed == 1 and killed.state.is_crashed(), killed
        assert killed.state.message == "killed by signal 9", killed.state
        for flow_run in (created, killed):
            client.delete_flow_run(flow_run.id)


@pytest.fixture(scope="module")
def workers(deployed, s3_server, tmp_path_factory):
    """A process worker per region's pool. They hold no S3 credentials: the flow runs take
    them from a Secret block, named in the workers' environment."""
    from prefect.blocks.system import Secret

    logs = tmp_path_factory.mktemp("workers")
    Secret(value={k: os.environ[k] for k in S3_ENV}).save(SECRET_BLOCK, overwrite=True)
    env = {k: v for k, v in deployed.items() if k not in S3_ENV}
    env.update(DILOCO_CREDENTIALS_BLOCK=SECRET_BLOCK, PREFECT_WORKER_QUERY_SECONDS="1",
               PREFECT_HOME=str(logs / "prefect-home"))  # fmt: skip
    procs = {}
    for pool in POOLS:
        with open(logs / f"{pool}.log", "wb") as out:
            procs[pool] = subprocess.Popen(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
                 "--type", "process"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=logs,
            )  # fmt: skip
    yield logs
    # every flow run they started has ended (the tests check it); a worker told to stop
    # outlived a 30 s wait each (the suite's teardown took 60 s), so it gets 5 s, then a kill
    for proc in procs.values():
        proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 5
    for proc in procs.values():
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


TINY = ["topology.learners=2", "budget.tokens=40960", "pipeline.syncer_shards=1",
        "pipeline.round_steps=20", "pipeline.rounds_per_flow_run=1", "pipeline.checkpoint_every=20",
        "pipeline.versions_per_flow_run=4", "pipeline.poll_seconds=0.1",
        "pipeline.eval_seconds=5", "pipeline.spares=0"]  # fmt: skip


@pytest.mark.slow
def test_a_run_from_the_train_deployment_is_tagged_and_links_its_flow_runs(workers, tmp_path):
    """`train/us-east` run on a worker, its workers launched as flow runs of the regions'
    deployments, over an S3 region (whose credentials only a Secret block holds) and a
    file:// one: the launcher's flow run is tagged run:NAME, launcher and via:deployments,
    and every learner and syncer flow run of the run is a subflow of it, under the task
    run that started it. (Launched as processes, the same links are checked by
    ``tests/test_pipeline.py``'s chaos run, and the chain of bounded flow runs too.)"""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.deployments import run_deployment

    bucket = f"deploy-{uuid.uuid4().hex[:8]}"
    fsspec.filesystem("s3").mkdir(bucket)
    (tmp_path / "eu").mkdir()
    regions = {"us-east": f"s3://{bucket}", "eu-west": f"file://{tmp_path / 'eu'}"}
    via, run = "deployments", f"dep-{uuid.uuid4().hex[:6]}"
    # A deployment's flow run is a process of its own (tens of seconds to start here):
    # fewer of them.
    chained = ["pipeline.rounds_per_flow_run=2", "pipeline.versions_per_flow_run=8"]
    params = {"run": run, "regions": regions, "via": via, "logs": str(tmp_path / "logs"),
              "overrides": TINY + chained}  # fmt: skip
    launcher = run_deployment("train/us-east", parameters=params, timeout=0)
    deadline = time.monotonic() + 600
    with _client() as client:
        while time.monotonic() < deadline:
            launcher = client.read_flow_run(launcher.id)
            if launcher.state.is_final():
                break
            time.sleep(2)
        logs = "".join(p.read_text(errors="replace") for p in workers.glob("*.log"))
        assert launcher.state.is_completed(), f"{launcher.state}\n{logs[-6000:]}"
        assert {f"run:{run}", "launcher", f"via:{via}"} <= set(launcher.tags), launcher.tags
        flow_runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run}"])), limit=200
        )
        children = [f for f in flow_runs if f.id != launcher.id]
        names = {f.name for f in children}
        assert {"learner us-east/0", "learner eu-west/1", "syncer us-east/0"} <= names, names
        for child in children:
            assert child.state.is_completed(), (child.name, child.state)
            stand_in = subflow_of(client, child, launcher.id, "run")
            assert stand_in.state.is_completed(), (child.name, stand_in.state)
        # (the workers print what their flow runs' pull steps print)
        assert f"credentials from Secret block '{SECRET_BLOCK}'" in logs
    assert fsspec.filesystem("s3").ls(f"{bucket}/{run}"), "nothing reached the S3 bucket"
