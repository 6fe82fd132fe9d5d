"""The battery of bad inputs: every command, fed mistakes a user makes, answers each with one
line on stderr that starts `error:`, exit code 2, no traceback, and leaves nothing behind:
no run directory, no temp file, no worker started (docs/acceptance.md counts it).

Each case runs in this process through the command's own `main(argv)` under `run_cli`, the
way `python -m dtk.X` runs it, so the battery takes seconds; a few run as real processes
too. Slurm is there but does not answer (squeue & co. say "Unable to contact slurm
controller", on a clock that moves without waiting), and the lab's state folder is an
empty one, so no case can touch the real lab.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import dtk
from fake_slurm import FakeClock

MAINS = {
    "submit": "dtk.submit.__main__", "plan": "dtk.plan.__main__", "status": "dtk.status", "stop": "dtk.stop",
    "report": "dtk.report.__main__", "handover": "dtk.handover", "checkpoint": "dtk.checkpoint.__main__",
    "data": "dtk.data.__main__", "doctor": "dtk.doctor.__main__", "drill": "dtk.drill.__main__", "nodes": "dtk.nodes",
    "access": "dtk.access.__main__", "lab": "dtk.lab.__main__", "init": "dtk.init",
}

# (command, arguments, a piece of the error line). In the arguments: FILE a plain file,
# NODTK a folder without plan.json, NOTJSON / NOTDTK run folders whose plan.json is not
# JSON / not dtk's, RUN a planned run (plan.json, no checkpoint), SLURMRUN a run whose job
# is on Slurm, FULL a non-empty folder, DATA a prepared dataset, TOKENS a .npy of tokens.
CASES: list[tuple[str, str, str]] = [
    # submit: the login node catches it before the queue
    ("submit", "train.global_batch=30 train.micro_batch=4", "is not a multiple of train.micro_batch"),
    ("submit", "train.global_batch=31", "does not split over the data-parallel size 2"),
    ("submit", "nodes=0", "nodes=0: expected a positive integer"),
    ("submit", "nodes=2", "the local cluster is this one machine"),
    ("submit", "tasks_per_node=0", "tasks_per_node=0: expected a positive integer"),
    ("submit", "model.num_layerz=2", "unknown key 'model.num_layerz'"),
    ("submit", "+model.num_layerz=2", "unknown key 'model.num_layerz'"),
    ("submit", "optim.beta1=1.5", "optim.beta1=1.5: expected a value in [0, 1)"),
    ("submit", "optim.min_lr_ratio=2", "optim.min_lr_ratio=2.0: expected a fraction"),
    ("submit", "optim.weight_decay=-1", "optim.weight_decay=-1.0"),
    ("submit", "optim.lr=0", "optim.lr=0.0: expected a positive learning rate"),
    ("submit", "cluster.time_min=0", "cluster.time_min=0: expected a positive integer"),
    ("submit", "fault.signal_lead_floor_s=0", "fault.signal_lead_floor_s=0"),
    ("submit", "cluster.device_memory_gb=0", "cluster.device_memory_gb=0.0"),
    ("submit", "fault.max_restarts=-1", "fault.max_restarts=-1: expected 0 or more"),
    ("submit", "optim.lr=inf", "optim.lr=inf: expected a positive learning rate"),
    ("submit", "optim.lr=nan", "optim.lr=nan: expected a positive learning rate"),
    ("submit", "fault.spike_factor=0.5", "fault.spike_factor=0.5: expected 0 (only non-finite losses are bad) or a"
     " factor above 1"),
    ("submit", "fault.spike_factor=1", "fault.spike_factor=1.0: expected 0"),
    ("submit", "fault.spike_window=0", "fault.spike_window=0: expected a positive count of good steps"),
    ("submit", "fault.max_rollbacks=-1", "fault.max_rollbacks=-1: expected 0 (fail at the first divergence) or more"),
    ("submit", "scheme.tp=2", "scheme.* keys need a scheme chosen first"),
    ("submit", "+scheme=nope", "scheme=nope: no such scheme"),
    ("submit", "cluster=nope", "cluster=nope"),
    ("submit", "data=hdf5 data.path=/nonexistent", "data.path=/nonexistent: no such folder"),
    ("submit", "+scheme=pp model.split_points=[layers.9]", "layers.9 is no pipeline unit"),
    ("submit", "+scheme=tp +model.tp_plan={lyers.0.attn.wq:colwise}", "the pattern lyers.0.attn.wq matches no module"),
    ("submit", "model.wrap_classes=[Blok]", "model.wrap_classes: Blok is no class of a module"),
    ("submit", "+scheme=tp scheme.tp=3", "tp=3 = 3, but the world size (nodes x tasks_per_node) is 2"),
    ("submit", "model.num_heads=3", "model.num_heads=3 does not divide model.dim"),
    ("submit", "run.root=FILE", "cannot create a run directory there"),
    ("submit", "run.root=FILE submit.dry_run=true", "cannot create a run directory there"),
    ("submit", "run.name=a/b", "run.name=a/b: expected a plain folder name"),
    ("submit", "submit.after=4711", "only a Slurm job can wait for another"),
    ("submit", "submit.after=abc", "submit.after=abc: expected a Slurm job id"),
    ("submit", "train.steps=0", "train.steps=0: expected a positive integer"),
    ("submit", "checkpoint.keep=0", "checkpoint.keep=0: expected a positive integer"),
    ("submit", "notanoverride", "is not KEY=VALUE"),
    ("submit", "=3", "has no key before '='"),
    ("submit", "--frob", "unrecognized arguments: --frob"),
    ("submit", "model=hf model.config=/nowhere model.vocab_size=256 +model.bogus=1", "unknown key 'model.bogus'"),
    ("submit", "spare_nodes=1", "spare nodes need a Slurm cluster"),
    ("submit", "dist.device=tpu", "dist.device"),
    ("submit", "train.seed=abc", "train.seed"),
    ("submit", "-m optim.lr=1e-3,-1", "optim.lr=-1.0: expected a positive learning rate"),
    ("submit", "cluster=lab nodes=2 tasks_per_node=1", "Unable to contact slurm controller"),
    ("submit", "cluster=lab nodes=1 submit.after=4711", "Unable to contact slurm controller"),
    ("submit", "cluster.exclude_from=/nowhere/list.txt cluster=lab submit.dry_run=true", "cluster.exclude_from=/nowhere"),
    # plan
    ("plan", "nodes=-1", "nodes=-1: expected a positive integer"),
    ("plan", "+scheme=tp scheme.tp=4", "tp=4 = 4, but the world size (nodes x tasks_per_node) is 2"),
    ("plan", "plan.params=-1", "plan.params=-1"),
    ("plan", "--json --frob", "unrecognized arguments: --frob"),
    ("plan", "cluster.accelerator=h999", "h999"),
    ("plan", "train.micro_batch=0", "train.micro_batch=0"),
    ("plan", "optim.eps=0", "optim.eps=0.0"),
    ("plan", "optim.beta2=1", "optim.beta2=1.0"),
    ("plan", "scheme.pp=2", "scheme.* keys need a scheme chosen first"),
    ("plan", "model.split_points=[nope]", "nope is no pipeline unit"),
    ("plan", "cluster.mem_gb=0", "cluster.mem_gb=0"),
    ("plan", "fault.straggler_factor=0.5", "fault.straggler_factor=0.5"),
    # status
    ("status", "NODTK", "not a dtk run directory (no plan.json)"),
    ("status", "NOTJSON", "its plan.json does not parse"),
    ("status", "NOTDTK", "its plan.json is not a dtk plan"),
    ("status", "LISTPLAN", "its plan.json is not a dtk plan"),
    ("status", "MISSING", "no such directory"),
    ("status", "", "the following arguments are required: RUN_DIR"),
    ("status", "RUN --frob", "unrecognized arguments: --frob"),
    ("status", "RUN RUN", "unrecognized arguments"),
    # stop
    ("stop", "NODTK", "not a dtk run directory (no plan.json)"),
    ("stop", "NOTDTK", "its plan.json is not a dtk plan"),
    ("stop", "NOTJSON", "its plan.json does not parse"),
    ("stop", "SLURMRUN", "Is slurmctld up"),
    ("stop", "RUN --timeout abc", "--timeout"),
    ("stop", "", "the following arguments are required"),
    ("stop", "RUN --later", "unrecognized arguments: --later"),
    ("stop", "MISSING", "not a dtk run directory"),
    # report
    ("report", "MISSING", "no such directory"),
    ("report", "NODTK", "not a dtk run directory (no plan.json)"),
    ("report", "NOTJSON", "its plan.json does not parse"),
    ("report", "NOTDTK", "its plan.json is not a dtk plan"),
    ("report", "RUN --out FILE", "is a file; name a folder"),
    ("report", "RUN --out FILE/x", "is a file, so nothing can be created under it"),
    ("report", "RUN --out /proc/dtk-report", "cannot write in /proc"),
    ("report", "RUN --baseline MISSING", "no such directory"),
    ("report", "RUN --tolerance abc", "--tolerance"),
    ("report", "", "the following arguments are required"),
    # handover
    ("handover", "MISSING --out OUT", "no plan.json"),
    ("handover", "NODTK --out OUT", "no plan.json"),
    ("handover", "NOTDTK --out OUT", "its plan.json is not a dtk plan"),
    ("handover", "NOTJSON --out OUT", "its plan.json does not parse"),
    ("handover", "RUN --out FILE", "is a file; name a folder"),
    ("handover", "RUN --out FULL", "exists and is not an empty folder"),
    ("handover", "RUN --out FILE/x", "is a file, so nothing can be created under it"),
    ("handover", "RUN --out /proc/dtk-handover", "cannot write in /proc"),
    ("handover", "RUN", "the following arguments are required: --out"),
    # checkpoint
    ("checkpoint", "list MISSING", "MISSING"),
    ("checkpoint", "list", "the following arguments are required"),
    ("checkpoint", "frob RUN", "invalid choice: 'frob'"),
    ("checkpoint", "export RUN --out FULL", "is a folder; name a file"),
    ("checkpoint", "export RUN --out FILE/x.pt", "is a file, so nothing can be created under it"),
    ("checkpoint", "export RUN --out /proc/dtk-x.pt", "cannot write in /proc"),
    ("checkpoint", "export RUN --out OUT.pt --format xyz", "invalid choice: 'xyz'"),
    ("checkpoint", "export RUN --out OUT.pt", "no"),
    ("checkpoint", "export RUN --out OUT.pt --step abc", "--step"),
    ("checkpoint", "export NOTJSON --out OUT.pt", "its plan.json does not parse"),
    ("checkpoint", "export MISSING --out OUT.pt", "no such run directory"),
    ("checkpoint", "delete RUN", "the following arguments are required: --step"),
    ("checkpoint", "delete RUN --step 999", "999"),
    # data
    ("data", "prepare --input /nowhere.npy --out OUT", "/nowhere.npy"),
    ("data", "prepare --input TOKENS --out OUT --seq-len 0", "--seq-len"),
    ("data", "prepare --input TOKENS --out OUT --seq-len abc", "--seq-len"),
    ("data", "prepare --input TOKENS --out FILE", "FILE"),
    ("data", "prepare --input TOKENS --out OUT --samples-per-shard 0", "--samples-per-shard"),
    ("data", "prepare --out OUT", "the following arguments are required: --input"),
    ("data", "prepare --input FILE --out OUT", "13 tokens, fewer than one sample of 65"),
    ("data", "info /nowhere", "/nowhere"),
    ("data", "verify NODTK", "NODTK"),
    ("data", "frob", "invalid choice: 'frob'"),
    ("data", "prepare --input TOKENS --out DATA", "DATA"),
    # doctor
    ("doctor", "doctor.min_mb=0", "doctor.min_mb=0"),
    ("doctor", "doctor.repeats=0", "doctor.repeats=0"),
    ("doctor", "doctor.slow_factor=1", "slow_factor"),
    ("doctor", "doctor.matmul_n=0", "doctor.matmul_n=0"),
    ("doctor", "doctor.p2p_mb=0", "doctor.p2p_mb=0"),
    ("doctor", "nodes=2", "nodes=2: the local cluster is this one machine"),
    ("doctor", "run.root=FILE", "cannot create a run directory there"),
    ("doctor", "doctor.frob=1", "doctor.frob"),
    ("doctor", "tasks_per_node=0", "tasks_per_node=0"),
    ("doctor", "cluster=lab nodes=2 tasks_per_node=1", "Unable to contact slurm controller"),
    # drill
    ("drill", "frob RUN", "invalid choice: 'frob'"),
    ("drill", "crash MISSING", "not a dtk run directory"),
    ("drill", "crash NODTK", "not a dtk run directory"),
    ("drill", "crash NOTDTK", "its plan.json is not a dtk plan"),
    ("drill", "preempt RUN", "RUN"),
    ("drill", "crash RUN --rank abc", "--rank"),
    ("drill", "hang RUN --hold abc", "--hold"),
    ("drill", "", "the following arguments are required"),
    # nodes
    ("nodes", "MISSING", "not a dtk run directory"),
    ("nodes", "NODTK", "not a dtk run directory"),
    ("nodes", "RUN --readmit node9", "node9"),
    ("nodes", "", "the following arguments are required"),
    ("nodes", "RUN --frob", "unrecognized arguments: --frob"),
    # access
    ("access", "show /nowhere.yaml", "/nowhere.yaml"),
    ("access", "show FILE", "FILE"),
    ("access", "show nopolicy", "nopolicy"),
    ("access", "prepare OUT --policy /nowhere.yaml", "/nowhere.yaml"),
    ("access", "prepare OUT", "the following arguments are required: --policy"),
    ("access", "frob", "invalid choice: 'frob'"),
    ("access", "show", "the following arguments are required"),
    # lab (its state folder is an empty one here: nothing reaches the real lab)
    ("lab", "frob", "invalid choice: 'frob'"),
    ("lab", "up --nodes 0", "--nodes=0 is out of range"),
    ("lab", "up --nodes 999", "--nodes=999 is out of range"),
    ("lab", "up --nodes abc", "--nodes"),
    ("lab", "up --timeout abc", "--timeout"),
    ("lab", "slow node1", "the following arguments are required: RATE"),
    ("lab", "slow node1 1gbit", "no lab is running from"),
    ("lab", "down --now", "unrecognized arguments: --now"),
    # init
    ("init", "FULL", "FULL"),
    ("init", "FILE", "FILE"),
    ("init", "OUT --name 1bad", "1bad"),
    ("init", "OUT --name with-dash", "with-dash"),
    ("init", "FILE/proj", "FILE"),
    ("init", "", "the following arguments are required: DIR"),
]

SUBPROCESS = [  # the same answers from real processes, as a user types them
    ("submit", "train.global_batch=30 train.micro_batch=4"),
    ("plan", "scheme.pp=2"),
    ("status", "NOTDTK"),
    ("report", "RUN --out FILE"),
    ("checkpoint", "list MISSING"),
    ("lab", "up --nodes 0"),
]

UNANSWERED = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"


class Started(BaseException):
    """A worker would have started: no except clause of dtk catches it."""


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, Path]:
    import numpy as np

    from dtk.common.rundir import RunDir
    from dtk.config.compose import compose
    from dtk.launch.launch import prepare_run_dir
    from dtk.plan.plan import make_plan

    root = tmp_path_factory.mktemp("bad")
    places = {"FILE": root / "file.txt", "NODTK": root / "nodtk", "NOTJSON": root / "notjson",
              "NOTDTK": root / "notdtk", "LISTPLAN": root / "listplan", "FULL": root / "full",
              "MISSING": root / "missing", "OUT": root / "out", "TOKENS": root / "tokens.npy",
              "DATA": root / "data", "RUN": root / "runs" / "run", "SLURMRUN": root / "runs" / "slurmrun"}
    places["FILE"].write_text("not a folder\n")
    for name in ("NODTK", "NOTJSON", "NOTDTK", "LISTPLAN", "FULL", "DATA"):
        places[name].mkdir()
    (places["NOTJSON"] / "plan.json").write_text("not json")
    (places["NOTDTK"] / "plan.json").write_text(json.dumps({"name": "someone else's"}))
    (places["LISTPLAN"] / "plan.json").write_text("[1, 2]")
    (places["FULL"] / "x").write_text("x")
    (places["DATA"] / "x").write_text("x")
    np.save(places["TOKENS"], np.arange(4000, dtype=np.int32) % 200)
    for name in ("RUN", "SLURMRUN"):
        cfg = compose([f"run.root={root / 'runs'}", f"run.name={places[name].name}"])
        prepare_run_dir(make_plan(cfg))
    RunDir(places["SLURMRUN"]).event("submitted", cluster="slurm", job_id="4711", world_size=2, scheme="ddp")
    return places


def fill(args: str, places: dict[str, Path]) -> list[str]:
    words = []
    for word in shlex.split(args):
        for name, path in sorted(places.items(), key=lambda kv: -len(kv[0])):
            if word == name or word.startswith((f"{name}/", f"{name}.")) or word.endswith(f"={name}"):
                word = word.replace(name, str(path), 1)
                break
        words.append(word)
    return words


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path with its file's size and time: a folder's own time changes when a check
    makes and removes a probe in it (dtk.common.errors.check_out), which leaves nothing."""
    return {str(p.relative_to(root)): (0, 0) if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*")}


@pytest.fixture
def quiet_slurm(places, tmp_path, monkeypatch):
    """Slurm's programs on PATH that do not reach a controller; the lab's folder empty."""
    from dtk.launch import slurmctl

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in ("squeue", "scontrol", "sinfo", "sbatch", "scancel", "sacct", "srun"):
        script = bin_dir / program
        script.write_text(f"#!/bin/sh\necho '{UNANSWERED}' >&2\nexit 1\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DTK_LAB_DIR", str(tmp_path / "lab"))
    monkeypatch.setattr(slurmctl, "Clock", FakeClock)  # slurmctl's retries without the wait
    return bin_dir


@pytest.fixture
def no_workers(monkeypatch):
    from dtk.doctor import __main__ as doctor
    from dtk.driver import local

    def started(*args, **kwargs):
        raise Started("a worker was started")

    monkeypatch.setattr(local.LocalDriver, "start", started)
    monkeypatch.setattr(doctor, "_run_local", started)


def run_in_process(command: str, argv: list[str], capsys) -> tuple[int, str, str]:
    import importlib

    from dtk.common.errors import run_cli

    main = importlib.import_module(MAINS[command]).main
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def assert_clean(command: str, args: str, code: int, out: str, err: str, expected: str) -> None:
    said = f"{command} {args}: exit {code}\nstdout: {out}\nstderr: {err}"
    assert code == 2, said
    assert "Traceback" not in out + err, said
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), said
    assert expected in lines[0], said


@pytest.mark.parametrize(("command", "args", "expected"), CASES, ids=[f"{c} {a}" for c, a, _ in CASES])
def test_a_bad_input_is_one_error_line_and_leaves_nothing(command, args, expected, places, quiet_slurm, no_workers,
                                                          capsys, monkeypatch, tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # a relative run.root (runs/) would land here
    root = places["FILE"].parent
    before = snapshot(root)
    private_tmp = tmp_path / "tmp"  # this test's own TMPDIR: other processes' temporary files are not its
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    code, out, err = run_in_process(command, fill(args, places), capsys)
    expected = str(places[expected]) if expected in places else expected
    assert_clean(command, args, code, out, err, expected)
    assert snapshot(root) == before, f"{command} {args} changed the files it was given"
    assert not any(work.iterdir()), f"{command} {args} wrote into the current folder"
    left = set(os.listdir(private_tmp))
    assert not left, f"{command} {args} left {left}"


def test_the_battery_covers_every_command_and_docs_acceptance_counts_it():
    import re

    from conftest import REPO

    per_command = {c: sum(1 for case in CASES if case[0] == c) for c in MAINS}
    assert len(CASES) >= 120 and all(n >= 5 for n in per_command.values()), per_command
    text = (REPO / "docs" / "acceptance.md").read_text()
    table = text.split("<!-- bad inputs: per command -->")[1].split("<!-- end bad inputs -->")[0]
    counted = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| (\w+) \| (\d+) \|$", table, re.M)}
    assert counted == {**per_command, "all": len(CASES)}


@pytest.mark.parametrize(("command", "args"), SUBPROCESS, ids=[f"{c} {a}" for c, a in SUBPROCESS])
def test_a_real_process_answers_the_same(command, args, places, tmp_path):
    module = MAINS[command].removesuffix(".__main__")
    expected = next(e for c, a, e in CASES if (c, a) == (command, args))
    expected = str(places[expected]) if expected in places else expected
    proc = dtk(module, *fill(args, places), cwd=tmp_path, env={"DTK_LAB_DIR": str(tmp_path / "lab")})
    assert_clean(command, args, proc.returncode, proc.stdout, proc.stderr, expected)
    assert not any(tmp_path.iterdir())


def test_two_doctors_in_the_same_second_get_folders_of_their_own(tmp_path):
    from dtk.doctor.__main__ import _new_folder

    first, second = _new_folder(tmp_path, "doctor-20260101-000000"), _new_folder(tmp_path, "doctor-20260101-000000")
    assert first != second and first.is_dir() and second.is_dir() and second.name == "doctor-20260101-000000-2"


if sys.platform != "linux":  # /proc stands for a folder nobody can write, root included
    pytestmark = pytest.mark.skip(reason="the battery's unwritable folder is /proc")


def test_submit_after_while_slurmctld_does_not_answer_is_one_line(quiet_slurm, capsys):
    """The dependency check of a Slurm submission (after the partitions answered)."""
    from dtk.common.errors import run_cli
    from dtk.launch import slurmctl
    from dtk.launch.launch import check_dependencies

    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda argv: check_dependencies("4711", slurmctl.job_state), [])
    out, err = capsys.readouterr()
    assert_clean("submit", "submit.after=4711", exit_info.value.code, out, err, "Is slurmctld up")
    assert "squeue -h -j 4711" in err and "Unable to contact slurm controller" in err
