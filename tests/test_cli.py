"""The `diloco` command's own surface: --version, `config show`, the --set help, the
inspect legend, and the hints that the CLI and the local stack print."""

import importlib.metadata
import json
import os
import re
import sys
import time

import numpy as np
import pytest
from pydantic import BaseModel

from diloco.config import RunConfig
from flows.cli import build_parser, config_rows, main, package_version
from flows.cli_buckets import INSPECT_LEGEND, speed_line
from storage_layout.store import RunStore


def leaf_fields(model: BaseModel, prefix: str = "") -> dict[str, str | None]:
    out = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out.update(leaf_fields(value, f"{prefix}{name}."))
        else:
            out[prefix + name] = field.description
    return out


def test_version_comes_from_the_package_metadata(capsys, monkeypatch):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert (
        capsys.readouterr().out.strip()
        == f"diloco {importlib.metadata.version('decoupled-diloco')}"
    )

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert package_version().endswith("(not installed)")  # pyproject.toml's version


def test_every_config_field_has_a_meaning():
    fields = leaf_fields(RunConfig())
    assert not [k for k, d in fields.items() if not d], "fields without description="
    rows = {key: (value, meaning) for key, value, meaning in config_rows(RunConfig())}
    assert set(fields) <= set(rows)
    assert rows["outer.lr"] == ("1.0", fields["outer.lr"]) and rows["data.source"][0] == "null"
    assert rows["outer"][0] == ""  # a section: its model's description
    assert rows["outer"][1].startswith("Syncer side")


def test_config_show_prints_values_and_meanings(capsys):
    code = main(["config", "show", "--preset", "small", "--set", "outer.lr=0.25",
                 "--set", 'sim.failures=[{"learner": 1, "at": 0.1, "duration": 0.2}]'])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") >= 3}
    assert set(leaf_fields(RunConfig())) <= set(lines)
    assert "0.25" in lines["outer.lr"] and "outer learning rate" in lines["outer.lr"]
    assert "192" in lines["model.width"]  # the preset's
    assert '"learner": 1' in lines["sim.failures"]


def test_config_show_names_a_bad_field(capsys):
    assert main(["config", "show", "--set", "outer.lr=-1"]) == 2
    assert "outer.lr" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "simulate"])
def test_set_help_says_where_the_keys_are(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    assert "diloco config show" in " ".join(capsys.readouterr().out.split())


def test_inspect_explains_its_columns(tmp_path, capsys):
    url = f"file://{tmp_path}"
    store = RunStore("r", {"us": url}, "us", writer="syncer")
    spec = {"regions": {"us": url}, "learners": {"l0": "us", "l1": "us"}, "fragments": [["w"]],
            "config": {"budget": {"tokens": 19_000}}}  # fmt: skip
    store.ensure_spec(spec)
    now = time.time()
    for v, (age, tokens) in enumerate([(100.0, 0), (10.0, 9_000)]):  # 100 tokens/s between
        store.versions.publish_global(0, v, {"w": np.zeros(3, np.float32)}, [],
                                      {"consumed": [], "members": ["l0"], "quorum": 1,
                                       "time": now - age, "tokens_total": tokens}, "bf16")  # fmt: skip
    # l0 took its slot by `diloco join` and trains; l1's slot never started
    RunStore("r", {"us": url}, "us", writer="l0").progress.write_metrics(
        "l0", {"state": "training", "time": time.time() - 30}
    )
    store.members.put_join(
        "l0", lambda n: json.dumps({"learner": "l0", "join": n, "time": time.time()}).encode()
    )
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    for column in ("newest", "per region", "kept", "consumed", "quorum / members", "state",
                   "joins", "newest seq", "staleness", "checkpoint", "bytes and requests"):  # fmt: skip
        assert column in out and column in INSPECT_LEGEND
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line}
    assert "1 / 1" in rows["0"]  # fragment 0: merged under quorum 1 of the 1 member
    # its pace over its versions, and the time left at it to the budget
    assert re.search(r"speed: 100/s tokens merged over the last versions · 9,000 of 19,000 "
                     r"tokens · 1 min 40 s left · newest version 1\d s ago", out), out  # fmt: skip
    l0, l1 = [c.strip() for c in rows["l0"].split("│")], [c.strip() for c in rows["l1"].split("│")]
    assert re.fullmatch(r"training, (29|3\d) s ago", l0[3]) and l0[4] == "1", l0
    assert l1[3:5] == ["never started", "0"], l1
    assert INSPECT_LEGEND.splitlines()[1].strip() in out
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    assert "staleness: newest version - base" in capsys.readouterr().out


def test_train_hint_runs_as_printed(monkeypatch):
    """`diloco train`'s closing inspect hint is this environment's command, or the one a
    wrapper that set up the environment names (the local stack's, which brings its env)."""
    from flows.train import _inspect_hint

    monkeypatch.delenv("DILOCO_INSPECT_HINT", raising=False)
    hint = _inspect_hint("s3://b", "r1")
    assert hint.endswith("diloco inspect s3://b --run r1")
    assert os.path.exists(hint.split()[0])  # relative to the current folder, or absolute
    monkeypatch.setenv("DILOCO_INSPECT_HINT", "py -m infra.local_stack inspect {url} --run {run}")
    assert _inspect_hint("s3://b", "r1") == "py -m infra.local_stack inspect s3://b --run r1"


def test_local_stack_hints_name_this_interpreter_and_its_inspect(tmp_path, monkeypatch, capsys):
    from infra import local_stack

    assert local_stack._me("run").split()[0] in (sys.executable, os.path.relpath(sys.executable))
    monkeypatch.setattr(local_stack, "STATE", tmp_path)
    with pytest.raises(SystemExit, match=r"no stack is up \(.*python.* -m infra.local_stack up\)"):
        local_stack.main(["inspect"])
    # `inspect` runs diloco inspect with the stack's env (what `source .stack/env` gives).
    (tmp_path / "state.json").write_text('{"pids": {}, "env": {"AWS_ENDPOINT_URL": "http://x"}}')
    calls = []
    monkeypatch.setattr(local_stack.subprocess, "call",
                        lambda argv, env, **kw: calls.append((argv, env)) or 0)  # fmt: skip
    assert local_stack.main(["inspect"]) == 0
    argv, env = calls[0]
    assert argv[1:4] == ["-m", "flows.cli", "inspect"] and env["AWS_ENDPOINT_URL"] == "http://x"
    assert argv[4:] == [local_stack.REGIONS["us-east"], "--run", local_stack.DEMO_RUN]
    # `run` tells diloco train to print that command as its inspect hint.
    local_stack.main(["run"])
    assert "-m infra.local_stack inspect {url} --run {run}" in calls[1][1]["DILOCO_INSPECT_HINT"]


def _ui_api_url(api: str) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(api.removesuffix("/api") + "/ui-settings", timeout=10) as r:
        return json.loads(r.read())["api_url"]


@pytest.mark.slow
def test_the_prefect_ui_asks_the_runs_own_server_for_its_api(tmp_path, monkeypatch):
    """The UI a run's server serves (the "View at" links during the run) asks that server,
    on its own port, not port 4200; so does the one the closing browse command starts,
    run as printed, whatever PREFECT_API_URL the user's shell holds."""
    import signal
    import subprocess

    from flows.train import browse_command
    from infra.prefect_server import free_port, prefect_server, wait_healthy

    home = tmp_path / "prefect"
    with prefect_server(home) as api:
        assert _ui_api_url(api) == api
        assert not api.endswith(":4200/api")  # a free port: the case that broke
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # some other server
    port = free_port()
    command = browse_command(home, port)
    assert f"http://127.0.0.1:{port}/runs" in command
    log = (tmp_path / "browse.log").open("wb")
    proc = subprocess.Popen(command.split("  (then")[0], shell=True, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        api = f"http://127.0.0.1:{port}/api"
        wait_healthy(api, proc, tmp_path / "browse.log")
        assert _ui_api_url(api) == api
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def test_train_refuses_an_empty_or_missing_region_folder(tmp_path, capsys, monkeypatch):
    """`--region us-east=` trained with the current folder as the bucket, and a typo'd
    folder silently became a new bucket. Both are refused by name before anything is
    written; --create-buckets makes missing folders, and the default regions (the run's
    own folders under DIR/RUN/buckets) are made as before."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "us").mkdir()
    bad_data = ["--set", f"data.source={tmp_path / 'no-data'}"]  # stops it before training
    code = main(["train", "--dir", "runs", "--run", "r", "--region", "us-east=",
                 "--region", f"eu-west={tmp_path / 'us'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "region 'us-east' has an empty bucket URL" in err, err
    code = main(["train", "--dir", "runs", "--run", "r", "--region", f"us-east={tmp_path / 'us'}",
                 "--region", f"eu-west=file://{tmp_path / 'eu-wst'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert (
        code == 2 and f"the folder {tmp_path / 'eu-wst'} of region 'eu-west' does not exist" in err
    )
    assert "--create-buckets" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["us"]  # nothing written anywhere
    code = main(["train", "--dir", "runs", "--run", "r", "--region", f"us-east={tmp_path / 'us'}",
                 "--region", f"eu-west={tmp_path / 'eu'}", "--create-buckets", *bad_data])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "no-data" in err and "does not exist" in err, err
    assert (tmp_path / "eu").is_dir()  # asked for: made
    code = main(["train", "--dir", "runs", "--run", "q", *bad_data])
    err = capsys.readouterr().err
    assert code == 2 and "no-data" in err, err
    assert sorted(p.name for p in (tmp_path / "runs" / "q" / "buckets").iterdir()) == [
        "eu-west", "us-east"
    ]  # fmt: skip


def test_train_takes_the_presets_budget_unless_tokens_are_given(tmp_path, monkeypatch):
    """Defect: `--preset base` trained 1 M tokens (the quick start's default replaced the
    preset's budget). A preset carries its budget; --tokens overrides it; with no preset
    a new run is the quick start, tiny at TRAIN_TOKENS."""
    from diloco.config import PRESETS
    from flows.cli import TRAIN_TOKENS

    seen = {}
    monkeypatch.setattr("flows.train.train",
                        lambda run, regions, cfg, root, via: seen.setdefault(run, cfg) and 0)  # fmt: skip
    for run, flags in (("a", ["--preset", "base"]), ("b", []), ("c", ["--preset", "tiny"]),
                       ("d", ["--preset", "small", "--tokens", "5000"])):  # fmt: skip
        assert main(["train", "--dir", str(tmp_path), "--run", run, *flags]) == 0
    assert seen["a"].budget.tokens == PRESETS["base"]["budget"]["tokens"] == 500_000_000
    assert seen["a"].model.width == PRESETS["base"]["model"]["width"]
    assert seen["b"].budget.tokens == TRAIN_TOKENS and seen["b"].model.width == 64
    assert seen["c"].budget.tokens == PRESETS["tiny"]["budget"]["tokens"]
    assert seen["d"].budget.tokens == 5000 and seen["d"].model.width == 192


def test_the_speed_of_a_run_done_or_with_too_few_versions():
    from storage_layout.inspect import run_speed

    def pace(tokens, rate):
        return {"pace": {"tokens_total": tokens, "time": 90.0, "tokens_per_second": rate}}

    done = run_speed([pace(2_000, 50.0), pace(2_100, 70.0)], 2_000, now=100.0)
    assert done == {"tokens": 2_050, "budget": 2_000, "tokens_per_second": 60.0,
                    "newest_age_s": 10.0, "seconds_left": 0.0}  # fmt: skip
    young = run_speed([pace(500, 50.0), pace(400, None)], 2_000, now=100.0)  # one has 1 version
    assert young["tokens_per_second"] is None and young["seconds_left"] is None
    assert run_speed([{"fragment": 0}], 2_000, now=100.0) is None  # no record with times
    assert "done" in speed_line(done) and "unknown left" in speed_line(young)
