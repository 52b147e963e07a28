"""``diloco join``: a machine takes a vacant learner slot of a running run, or adds one,
from its region's bucket alone.

A run starts with ``topology.learners`` slots (the spec's), each with its id, its
region, its share of the data (its stream of batches) and its checkpoints in the bucket.
A slot is **vacant** when its learner takes no part in the run now (preempted, or
silent: ``diloco.liveness``, by the run's own ``liveness.*`` settings, the spec's, never
the joiner's) or never started; a lagging learner holds its slot; a **done** slot
has trained its budget and is not vacant. A joiner picks the first vacant slot of its
region that it holds a key for, writes a signed join record (write-once, under the slot's
``joins/``), and becomes that slot's learner: it resumes from the slot's newest checkpoint
at the slot's data position, so no batch of the slot is skipped or trained twice whoever
trains it, and it needs no live donor, only the bucket. Several joiners may come at
once: a join record is the one after the newest its joiner saw when it chose the slot
(an exclusive create), so of two that chose one slot at the same moment the second
finds it written and chooses again; and each start claims the slot's next generation,
so a process whose generation is no longer the newest stops. A slot whose join record
is younger than ``liveness.silent_max_seconds`` and newer than its status is not
vacant: its joiner is on its way.

**A run grows** when a joiner finds no vacant slot in its region and the run takes its
data in units (``data.assign = "units"``: no slot owns a share of the data, each learner
takes units from its region's pool): it adds a slot beyond the spec's ``topology.learners``
by writing a signed **member record** (``members/{learner}.json`` in its region's bucket,
an exclusive create: two joiners never add the same one), under the first id its region
may add (``protocol.topology.learner_region``: learner-i lives in region i mod R of the
run's deal, so two regions never add the same id, and a region the run started no
learner in adds them too) that it holds a key for. The syncers
read every region's member records at each look at the members (``RunStore.members.run_learners``,
each checked against its learner's key) and merge the added learner's contributions from
the next version on; the audit, ``diloco inspect`` and the launcher's display know it
from the same records. An added slot is then a slot like the others: vacant when its
learner leaves, taken again by the next joiner. The run secret covers every id; a join
token covers the ids it names (``diloco join-token --learners 16`` opens learner-0 ..
learner-15, those beyond the spec's slots included).

Who may join: with the run secret (``DILOCO_RUN_SECRET``) any slot; with a join token
(``DILOCO_JOIN_TOKEN``, from ``diloco join-token``, which holds the keys of the slots the
owner chose and never the secret) those slots. A run whose contributions are signed (its
bucket holds the secret's fingerprint) refuses a joiner with neither, by name; the
syncers reject the contributions of a joiner whose token is forged. A token is checked
against the run before anything is taken (``check_token``): the run's buckets keep its
record (``issue_token``: its id, issue time, expiry and a check of each key, never the
keys), so a token of another run (relabelled), an expired one (``--expires``) or a
revoked one (``diloco join-token --revoke``) is refused by name. (Who can write to the
bucket can forge a record too; the syncers still reject what such a joiner sends.)

Silence is read on the joiner's own clock against the status object's time, written by
the learner's machine: clocks kept by NTP differ by far less than the timeout (600 s by
default).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from prefect import flow

from diloco.data import DataError
from diloco.syncer import budget_spent
from flows import workers
from flows.compile import share_compilations, user_cache
from flows.join_tokens import join_keys
from flows.notice import noting_ctrl_c
from flows.slots import Slot, choose_slot
from flows.spares import WORKER_COMMAND
from flows.spec import launched_pipeline
from protocol.topology import (
    learner_index,
)
from storage_layout.auth import (
    CLAIMS_KEY_ENV,
    JOIN_TOKEN_ENV,
    LEARNER_KEY_ENV,
    RUN_SECRET_ENV,
    JoinRefused,
    learner_key,
    sign_record,
)
from storage_layout.bucket import same_bucket
from storage_layout.faults import Injector
from storage_layout.store import RunStore

TAKE_TRIES = 8  # slots a joiner tries to take or add, each time another joiner was first


def check_region_url(spec: Mapping[str, Any], run: str, region: str, url: str) -> None:
    """``JoinRefused`` unless ``url`` is ``region``'s bucket in the run's spec: a joiner
    that names one region with another's bucket would take a slot of the other region,
    where another machine may hold it, with no fence between them."""
    urls = spec.get("regions") if isinstance(spec.get("regions"), dict) else {}
    if region not in urls:
        raise JoinRefused(f"run {run!r} has no region {region!r} (its regions: "
                          f"{', '.join(map(repr, urls))})")  # fmt: skip
    if not same_bucket(str(urls[region]), url):
        named = [r for r, u in urls.items() if same_bucket(str(u), url)]
        where = f" (it is region {named[0]!r}'s: pass --region {named[0]})" if named else ""
        raise JoinRefused(f"{url} is not region {region!r}'s bucket in run {run!r}: its spec "
                          f"gives {urls[region]!r}{where}")  # fmt: skip


def join(
    url: str,
    run: str,
    region: str,
    slot: str | None = None,
    pipeline: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    speed: float | None = None,
    warm: Callable[[dict[str, Any]], None] | None = None,
    interrupted: Callable[[], bool] = lambda: False,
) -> tuple[workers.Worker, dict[str, str]]:
    """Pick the slot, write its signed join record and return the slot's learner worker
    (``become`` runs its command line in place of this process) with the environment to
    run it in. ``JoinRefused`` (a ``ValueError``) names why a joiner may not join.

    ``pipeline`` is laid over the run's own settings (``launched_pipeline``: its
    newest launch's). ``warm`` (``join_and_train``: build the model, compile the step, read
    the corpus in this process, given those settings) runs once the joiner is known to be
    let in and a slot is vacant, and before the slot is taken (not for a learner of
    several processes, which starts them afresh): a slot is not held, nor counted as a
    member, by a machine that cannot train yet (a tiny learner's start took 20 to 60 s on
    2 busy cores, ``bench/elastic``). After it the joiner is refused if the run has
    trained its budget meanwhile, and the slot is chosen again (another may have taken
    it). ``interrupted`` (a Ctrl-C seen, ``join_and_train``) is asked before anything is
    written: such a joiner raises ``KeyboardInterrupt`` having taken nothing."""
    if speed is not None and not (isinstance(speed, int | float) and math.isfinite(speed)
                                  and speed > 0):  # fmt: skip
        raise JoinRefused(f"--speed {speed!r} is not a positive number (this machine's speed "
                          "hint, kept in its records)")  # fmt: skip
    env = dict(os.environ if environ is None else environ)
    faults = Injector.from_env(env)  # what it reads and writes meets the plan given it, if any
    store = RunStore(run, {region: url}, region, writer="joiner", faults=faults)
    opened, pipeline = _open(store, url, pipeline)
    cfg, spec = opened.cfg, opened.spec
    keys = _signing_keys(store, env, run)

    _refuse_if_spent(store, opened)
    grow = cfg.data.assign == "units"  # no slot owns data: a slot may be added

    def choose() -> Slot:
        return choose_slot(store, spec, region, keys, cfg.liveness, slot, grow)

    taken = choose()
    if warm is not None and cfg.pipeline.learner_processes == 1:
        began = time.time()
        print(f"warming up to join run {run} in {region} (the model, its compiled step, "
              f"the corpus) before taking a slot", flush=True)  # fmt: skip
        warm(pipeline)
        _refuse_if_spent(
            store, opened, " while this joiner warmed up"
        )  # the run may have ended meanwhile
        taken = choose()
        print(f"warm after {time.time() - began:.1f} s", flush=True)
    record = {"region": region, "host": socket.gethostname(), "pid": os.getpid(),
              "devices": _devices(), "speed": speed}  # fmt: skip
    taken, key, n = _take(store, url, taken, choose, record, env, keys, interrupted)
    print(f"joining run {run} as {taken.learner} in {region} (join {n}; the slot: "
          f"{taken.why})", flush=True)  # fmt: skip
    learner = workers.learner(run, url, region, learner_index(taken.learner), cfg, pipeline)
    return learner, _learner_env(env, key, store.claims_key)


def _learner_env(env: dict[str, str], key: bytes | None, claims_key: bytes | None) -> dict:
    """``env`` for the learner: its own key and the claims key (both, or neither), not
    the run secret nor the join token."""
    if key is not None and claims_key is not None:
        env[LEARNER_KEY_ENV] = key.hex()
        env[CLAIMS_KEY_ENV] = claims_key.hex()
    for secret in (RUN_SECRET_ENV, JOIN_TOKEN_ENV):
        env.pop(secret, None)
    return env


def _refuse_if_spent(store: RunStore, opened: Any, when: str = "") -> None:
    cfg = opened.cfg
    if _budget_spent(store, cfg, len(opened.spec.get("fragments") or [])):
        raise JoinRefused(f"run {store.run!r} has trained its budget{when} "
                          f"({cfg.budget.tokens:,} tokens, shared by its learners): there is "
                          "nothing left to join for")  # fmt: skip


def _open(store: RunStore, url: str, pipeline: Mapping[str, Any] | None) -> tuple[Any, dict]:
    """The run as the joiner sees it in ``store``'s region, with the run's own pipeline
    settings (its newest launch's) under ``pipeline``, and those settings; refused if
    this machine's data is not the run's."""
    from flows.run import Run
    from flows.spec import config_from_spec

    try:
        spec = store.read_spec()
    except FileNotFoundError as exc:
        raise JoinRefused(f"{url} holds no run {store.run!r} (its spec is missing)") from exc
    region = store.client_region
    check_region_url(spec, store.run, region, url)
    pipeline = {**launched_pipeline(store), **(pipeline or {})}
    cfg = config_from_spec(spec, pipeline)
    opened = Run(store.run, {region: url}, region, spec, cfg, faults=store.faults)
    try:  # before the warm-up: its data (another corpus here) would train nothing of the run's
        opened.data.check_same(spec, f"a joiner of run {store.run!r}")
    except DataError as exc:
        raise JoinRefused(str(exc)) from None
    return opened, pipeline


def _signing_keys(store: RunStore, env: Mapping[str, str], run: str) -> dict | None:
    """The slots' keys the joiner's token (or the run secret) gives (``join_keys``);
    None for a run that signs nothing (any slot, its sends unsigned as the others');
    ``JoinRefused`` for a run that signs, to a joiner holding neither."""
    keys = join_keys(store, env)
    if keys != {}:
        return keys
    if store.home.exists(store.layout.secret_fingerprint):
        raise JoinRefused(
            f"run {store.run!r} signs its contributions: a joiner needs a join token in "
            f"{JOIN_TOKEN_ENV} (the run's owner makes one with `diloco join-token`) or "
            f"the run secret in {RUN_SECRET_ENV}"
        )
    return None


def _take(store: RunStore, url: str, taken: Slot, choose: Callable[[], Slot],
          record: dict[str, Any], env: Mapping[str, str], keys: dict | None,
          interrupted: Callable[[], bool]) -> tuple[Slot, bytes | None, int]:  # fmt: skip
    """Take ``taken`` (choosing again, ``choose``, while other joiners take the slots
    first): a slot it adds gets its member record, then its join record, each written
    once. Returns the slot, its signing key and the join's number."""
    run, region = store.run, store.client_region
    for _ in range(TAKE_TRIES):
        if interrupted():  # a Ctrl-C noted while it warmed up or chose: nothing written
            raise KeyboardInterrupt
        lid, key = taken.learner, _key(env, keys, run, taken.learner)
        if taken.added and not store.members.put_member(  # its member record, written once
            lid, {**record, "learner": lid, "time": time.time()}, key
        ):
            taken = choose()  # another joiner added that one first
            continue
        joined = {**record, "learner": lid, "time": time.time(), "took": taken.why}
        writer = RunStore(run, {region: url}, region, writer=lid, claims_key=store.claims_key,
                          faults=store.faults)  # fmt: skip
        # The join after the newest this joiner saw, or none: another joiner that chose
        # the same slot at the same moment wrote it first, and this one chooses again.
        n = writer.members.put_join(lid, partial(_join_body, joined, key), after=taken.joins)
        if n is not None:
            return taken, key, n
        taken = choose()
    raise JoinRefused(f"{TAKE_TRIES} slots of region {region!r} of run {run!r} were each "
                      "taken by another joiner first")  # fmt: skip


def _join_body(record: dict[str, Any], key: bytes | None, n: int) -> bytes:
    """Join record ``n`` of ``record``, signed with the learner's ``key`` where the run
    signs."""
    signed = {**record, "join": n}
    if key is not None:
        signed = sign_record(signed, key)
    return json.dumps(signed, sort_keys=True).encode()


def _key(env: Mapping[str, str], keys: dict[str, bytes] | None, run: str, lid: str) -> bytes | None:
    """``lid``'s key: from the run secret, or the join token; None in a run that signs
    nothing."""
    if env.get(RUN_SECRET_ENV):
        return learner_key(env[RUN_SECRET_ENV], run, lid)
    return keys[lid] if keys else None


def _budget_spent(store: RunStore, cfg: Any, fragments: int) -> bool:
    """Whether the newest versions in this region report the run's shared budget merged
    (``diloco.syncer.budget_spent``, the syncers' own rule). A version whose progress is
    not a mapping of steps counts as none: the learner's start decides then."""
    progresses = []
    for p in range(fragments):
        version = store.versions.latest_global(p)
        if version is None:
            continue
        progress = store.versions.global_marker(p, version).meta.get("progress")
        try:
            progresses.append({str(k): int(v) for k, v in dict(progress or {}).items()})
        except (TypeError, ValueError):
            continue
    return budget_spent(cfg.shared_budget, cfg.budget_steps, progresses)


def _devices() -> str:
    """What this machine would train on, named without starting JAX (it is the worker's
    to start): the platform JAX is told to use, else what it finds."""
    return os.environ.get("JAX_PLATFORMS") or os.environ.get("CUDA_VISIBLE_DEVICES") or "auto"


def join_and_train(
    url: str,
    run: str,
    region: str,
    slot: str | None = None,
    pipeline: dict[str, Any] | None = None,
    speed: float | None = None,
    replace: bool = True,
    stop: threading.Event | None = None,
) -> tuple[str, int]:
    """``diloco join`` and the ``join`` flow: warm up, take a vacant slot (``take_slot``)
    and train as its learner (``become``) until it ends; returns the slot and the worker's
    exit status ("" and 130: interrupted before it took one). ``replace``: see ``become``;
    ``stop``: a Ctrl-C noted already (``diloco join`` notes them from its start)."""
    stop = threading.Event() if stop is None else stop
    with noting_ctrl_c(stop, JOINER_STOPS):
        taken = take_slot(url, run, region, slot, pipeline, speed, stop)
    if taken is None:
        return "", 130
    worker, env = taken
    return worker.writer, become(worker.argv(), env, replace)


JOINER_STOPS = ("this joiner leaves before it takes a slot, once the step of its warm-up "
                "under way ends (a compilation: seconds)")  # fmt: skip


def take_slot(
    url: str,
    run: str,
    region: str,
    slot: str | None,
    pipeline: dict[str, Any] | None,
    speed: float | None,
    stop: threading.Event,
) -> tuple[workers.Worker, dict[str, str]] | None:
    """``join`` with the learner's warm-up (``warm_up``, then the Prefect API; its JAX
    programs kept in ``user_cache()``, ``share_compilations``), stopped by
    ``stop`` (a Ctrl-C noted by ``flows.notice.noting_ctrl_c``, which its caller holds;
    ``diloco join`` from before it imports JAX) between two steps of the warm-up or before
    anything is written: then None, having taken nothing."""
    from flows.learner_runtime import warm_up

    # What it compiles is kept on this machine: back after a preemption, it loads it.
    share_compilations(user_cache() / "jax")

    def go_on() -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # (between two steps of the warm-up: none under way)

    def warm(settings: dict[str, Any]) -> None:
        warm_up(run, url, region, settings, go_on)
        go_on()
        prefect_api_up()

    try:
        go_on()
        return join(url, run, region, slot, pipeline, speed=speed, warm=warm,
                    interrupted=stop.is_set)  # fmt: skip
    except KeyboardInterrupt:
        print(f"interrupted before taking a slot of run {run}: this joiner leaves, having "
              "written nothing", flush=True)  # fmt: skip
        return None


# How long a joiner with no PREFECT_API_URL waits for Prefect's temporary server to answer
# (Prefect's own default is 20 s: too short for a machine busy training).
TEMPORARY_SERVER_SECONDS = 180


def prefect_api_up() -> None:
    """Reach the Prefect API the learner's flow runs will report to, in this process:
    with no ``PREFECT_API_URL`` (a machine that only joins, with no Prefect server of its
    own) that starts Prefect's temporary server, 10 s or more, which after the join
    record would hold a slot that no one trains yet. The learner worker, run in this
    process (``become``), reports to the same server. Prefect gives its temporary server
    20 s to answer, which a machine busy training (a joiner beside a run's learners on 2
    cores) overran: the joiner died in a traceback. It gets ``TEMPORARY_SERVER_SECONDS``,
    and one that does not start is named, with what to do."""
    from prefect.client.orchestration import get_client
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here
    if not PREFECT_API_URL.value():
        try:  # (one server a process: get_client below finds it running)
            SubprocessASGIServer().start(timeout=TEMPORARY_SERVER_SECONDS)
        except RuntimeError as exc:
            raise JoinRefused(
                f"Prefect's temporary server for this joiner's flow runs did not start within "
                f"{TEMPORARY_SERVER_SECONDS} s ({str(exc)[:300]}); set PREFECT_API_URL to a "
                "Prefect server this machine reaches, or try again when it is less busy"
            ) from exc
    with get_client(sync_client=True) as client:
        client.api_healthcheck()


@flow(name="join", log_prints=True)
def join_flow(
    run: str,
    region: str,
    bucket: str,
    slot: str | None = None,
    speed: float | None = None,
    pipeline: dict[str, Any] | None = None,
) -> str:
    """``diloco join`` as a Prefect flow (the ``join/REGION`` deployments of prefect.yaml):
    warms up, takes a vacant learner slot of ``run`` from ``bucket`` (the region's) and
    trains as the slot's learner in the flow run's process (its learner flow runs are
    this flow run's subflows) until it ends; returns the slot. A refused joiner fails the
    flow run, naming why (``JoinRefused``); a worker that fails fails it with its exit
    status. A SIGTERM to the flow run's process (a cancelled flow run, a spot notice) is
    the learner's preemption notice. The key comes from the work pool's environment
    (``DILOCO_JOIN_TOKEN`` or ``DILOCO_RUN_SECRET``), never from a parameter: Prefect
    records those."""
    lid, code = join_and_train(bucket, run, region, slot, pipeline, speed, replace=False)
    if not lid:
        raise RuntimeError(f"the joiner of run {run!r} was interrupted before it took a slot")
    if code:
        raise RuntimeError(f"the learner worker of {lid} in run {run!r} exited with {code}")
    return lid


def become(command: list[str], env: Mapping[str, str], replace: bool = True) -> int:
    """Run the learner worker as this process: its exit status is the joiner's, and a
    SIGTERM or a first Ctrl-C to this process is the worker's preemption notice (it
    leaves: ``WorkerProcess.leave_on_interrupt``). A ``flows.worker`` command
    runs here, in this process's environment made ``env`` (as a spare takes its job), so
    what the joiner warmed is the worker's. Any other (a learner of several processes,
    ``flows.hosts`` starting them), or any off the main thread (where no signal handler
    can be set), replaces this process, or, not ``replace`` (a flow run, which must see
    its own end), runs as its child with a SIGTERM to this process passed on."""
    sys.stdout.flush()
    sys.stderr.flush()
    here = threading.current_thread() is threading.main_thread()
    if command[:3] == WORKER_COMMAND and here:
        from flows.process import WorkerProcess
        from flows.worker import main

        process = WorkerProcess()
        process.leave_on_interrupt()  # the Ctrl-C of whoever lent this machine: a leave
        os.environ.clear()
        os.environ.update(env)
        return main(command[3:], process)
    if replace:
        os.execvpe(command[0], command, dict(env))
    proc = subprocess.Popen(command, env=dict(env))
    with contextlib.suppress(ValueError):  # off the main thread: none is passed on
        signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    return proc.wait()
