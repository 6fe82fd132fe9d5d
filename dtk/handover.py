"""python -m dtk.handover RUN_DIR --out DIR: the folder a team operates a setup by.

Everything is copied or generated from the run directory and this checkout of dtk:

    README.md            what each file is, and the command that repeats the run
    config/              the run's resolved config.yaml and plan.json; overrides.txt, the
                         command-line overrides that compose the same config (checked: same hash)
    conf/                the config folders of the run's own project (python -m dtk.init), copied:
                         `--config-dir` this folder composes the run again; project.txt names
                         each project folder and the git commit of its code
    run/                 the run's records (metrics, events, summary, system and eval samples,
                         plan): `python -m dtk.report NEW_RUN --baseline THIS_FOLDER` compares with it
    plan.txt             the plan: world size, degrees, batch arithmetic (python -m dtk.plan)
    plan.md              the topology scheme dtk.submit wrote into the run (marked missing for an older run)
    access.md            the access policy: roles, groups, members, what each may do
    recovery.md, operations.md, acceptance.md, reference.md, access-guide.md   from docs/
    report/              the run's report (report.txt, report.json) with its PNG plots
    status.json, audit.txt   where the run stands; who did what to it

The folder is written into a temporary folder of its own beside --out and moved in place
when complete; an existing empty --out keeps its owner, group and mode.

Exit code 0 when every artifact is there, 1 when the folder was written with some marked
missing in README.md (each says why), 2 for a user mistake (nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dtk.common import audit
from dtk.common.errors import ArgumentParser, UserError, check_out, run_cli
from dtk.common.rundir import CONFIG_YAML, EVAL_LOG, EVENTS, METRICS, PLAN_JSON, PLAN_MD, SUMMARY, SYSTEM_LOG, RunDir

DOCS = {"recovery.md": "recovery.md", "operations.md": "operations.md", "acceptance.md": "acceptance.md",
        "reference.md": "reference.md", "access-guide.md": "access.md"}


@dataclass
class Artifact:
    name: str
    what: str
    missing: str | None = None  # why it is not there


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m dtk.handover", description=__doc__.splitlines()[0],
                       epilog="\n".join(__doc__.splitlines()[2:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run to hand over (usually the baseline run)")
    p.add_argument("--out", metavar="DIR", type=Path, required=True, help="a new or empty folder")
    return p


def handover(run_dir: Path, out: Path) -> list[Artifact]:
    from dtk.plan.plan import Plan

    run = RunDir(run_dir)
    if not run.plan_json.is_file():
        raise UserError(f"RUN_DIR={run_dir}: not a dtk run directory (no plan.json)")
    check_out(out, folder=True)
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise UserError(f"--out {out}: exists and is not an empty folder; name a new one")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: no folder {out.parent} to write it in; create it first or name another")
    plan = Plan.read(run)
    # A folder of its own, inside an existing empty --out or beside a new one: nothing of
    # anybody else's is touched.
    where = out if out.is_dir() else out.parent
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.handover-", dir=where))
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write in {where} ({exc.strerror or exc})") from None
    try:
        (tmp / "config").mkdir()
        made = _write(run_dir, plan, tmp)
        _move_into(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written
        raise
    return made


def _move_into(tmp: Path, out: Path) -> None:
    """The finished folder becomes --out: renamed there, or, where --out is an empty folder
    already (a team's, with its owner, group and mode), its entries moved into it."""
    if out.is_dir():
        entries = list(tmp.iterdir())
        taken = [e.name for e in entries if (out / e.name).exists()]
        if taken:  # someone wrote into --out meanwhile: keep theirs
            raise UserError(f"--out {out}: {taken[0]} appeared there while the handover was written; name a new folder")
        for entry in entries:
            entry.rename(out / entry.name)
        tmp.rmdir()
        return
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 is for the folder while it is written, not for the team
    tmp.rename(out)


def _write(run_dir: Path, plan, tmp: Path) -> list[Artifact]:
    made: list[Artifact] = []
    shutil.copyfile(run_dir / CONFIG_YAML, tmp / "config" / CONFIG_YAML)
    shutil.copyfile(run_dir / PLAN_JSON, tmp / "config" / PLAN_JSON)
    made.append(Artifact("config/config.yaml, config/plan.json", "the run's resolved configuration and plan"))
    search = _project_conf(plan, tmp, made)
    made.append(_overrides(plan, tmp, search))
    made.append(_run_records(run_dir, tmp))
    (tmp / "plan.txt").write_text(plan.describe() + "\n")
    made.append(Artifact("plan.txt", "the plan: world size, parallel degrees, batch arithmetic"))
    made.append(_plan_md(run_dir, tmp))
    made.append(_access(plan, tmp))
    for name, source in DOCS.items():
        made.append(_doc(name, source, tmp))
    made.append(_report(run_dir, tmp))
    from dtk.common.rundir import RunDir
    from dtk.report.collect import collect

    (tmp / "status.json").write_text(json.dumps(collect(RunDir(run_dir)), indent=2, default=str) + "\n")
    made.append(Artifact("status.json", "where the run stands: state, step, checkpoints, starts (python -m dtk.status)"))
    entries = audit.read(audit.run_root_of(run_dir), run=plan.run_name)
    (tmp / "audit.txt").write_text("".join(audit.describe(e) + "\n" for e in entries) or "no audit entries\n")
    made.append(Artifact("audit.txt", "who submitted, drilled, exported or deleted what (the run root's audit/)"))
    (tmp / "README.md").write_text(_readme(plan, run_dir, made))
    return made


def _project_conf(plan, tmp: Path, made: list[Artifact]):
    """The config folders of the run's project(s) copied into conf/ (the first one's files win,
    as when the run was composed), and project.txt: each folder and its git commit. Returns
    the search path that composes from the handover folder."""
    from dtk.config.compose import SearchPath

    if not plan.import_path:
        return SearchPath()
    # As dtk.config.compose.search_path read them: a project folder's conf/, or the folder itself.
    folders = [(Path(m) / "conf" if (Path(m) / "conf").is_dir() else Path(m), Path(m)) for m in plan.import_path]
    for conf, _ in reversed(folders):
        if conf.is_dir():
            shutil.copytree(conf, tmp / "conf", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    lines = [f"{module}  {_git_commit(module)}" for _, module in folders]
    (tmp / "project.txt").write_text("# project folder  git commit of its code\n" + "\n".join(lines) + "\n")
    made.append(Artifact("conf/", "the config folders of the run's own project, as the run composed them"))
    made.append(Artifact("project.txt", "the run's project folder(s) and the git commit of their code"))
    return SearchPath(config=(tmp / "conf",), modules=tuple(Path(m) for m in plan.import_path))


def _git_commit(folder: Path) -> str:
    """HEAD of the git checkout holding `folder` (`+ changes` when its tree differs), or why none."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return "not a git checkout"
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"git could not say ({exc})"
    return head.stdout.strip() + (" + uncommitted changes" if dirty else "")


def _overrides(plan, tmp: Path, search) -> Artifact:
    from dtk.config.overrides import repeat_overrides
    name = "config/overrides.txt"
    overrides, why = repeat_overrides(plan.config, plan.config_hash, search=search)
    if overrides is None:
        return Artifact(name, "command-line overrides that compose the same config", missing=why)
    (tmp / name).write_text("".join(f"{o}\n" for o in overrides))
    return Artifact(name, "the command-line overrides that compose this run's config (same config hash)")


RUN_RECORDS = (PLAN_JSON, CONFIG_YAML, METRICS, EVENTS, SUMMARY, SYSTEM_LOG, EVAL_LOG)


def _run_records(run_dir: Path, tmp: Path) -> Artifact:
    """What a comparison with this run reads (dtk.report --baseline): its records, not its checkpoints."""
    folder = tmp / "run"
    folder.mkdir()
    for name in RUN_RECORDS:
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, folder / name)
    what = "the run's records (metrics, events, summary, samples): dtk.report --baseline takes this folder"
    if not (folder / METRICS).is_file():
        return Artifact("run/", what, missing="the run logged no step (no metrics.jsonl): nothing to compare with")
    return Artifact("run/", what)


def _plan_md(run_dir: Path, tmp: Path) -> Artifact:
    what = "the topology scheme: mesh, rank -> node placement, memory, traffic per axis, how to expand"
    if (run_dir / PLAN_MD).is_file() and (run_dir / PLAN_MD).stat().st_size:
        shutil.copyfile(run_dir / PLAN_MD, tmp / PLAN_MD)
        return Artifact(PLAN_MD, what)
    return Artifact(PLAN_MD, what, missing="the run directory has no plan.md (dtk.submit writes it; a run submitted"
                    " by an older dtk has none): python -m dtk.plan with the overrides in config/overrides.txt prints"
                    " the same budget; plan.txt has the plan")


def _access(plan, tmp: Path) -> Artifact:
    from dtk.access.text import render

    policy = plan.config.access  # a run from before access policies reads back with the default (open)
    (tmp / "access.md").write_text(f"# Access policy\n\n    {render(policy).replace(chr(10), chr(10) + '    ')}\n\n"
                                   "What each role may do and what enforces it: access-guide.md.\n")
    return Artifact("access.md", f"the access policy {policy.name}: roles, groups, today's members")


def docs_dir() -> Path:
    """The repository's docs/ (a checkout or an editable install; a wheel carries none)."""
    return Path(__file__).resolve().parents[1] / "docs"


def _doc(name: str, source: str, tmp: Path) -> Artifact:
    path = docs_dir() / source
    if not path.is_file():
        return Artifact(name, f"docs/{source}", missing=f"docs/{source} is not in this installation of dtk"
                        " (it comes with a checkout of the repository)")
    shutil.copyfile(path, tmp / name)
    return Artifact(name, f"docs/{source} of this dtk")


def _report(run_dir: Path, tmp: Path) -> Artifact:
    from dtk.report.assemble import build_parser as report_parser
    from dtk.report.assemble import render, report

    folder = tmp / "report"
    folder.mkdir()
    missing = None
    try:
        out = report(report_parser().parse_args([str(run_dir), "--out", str(folder)]))
    except UserError as exc:  # plots need matplotlib; the numbers do not
        out = report(report_parser().parse_args([str(run_dir), "--no-plots"]))
        missing = f"the plots: {exc}"
    # The plots as this folder holds them, not under the temporary folder it was written in.
    out["plots"] = [str(Path(p).relative_to(tmp)) for p in out.get("plots", [])]
    (folder / "report.txt").write_text(render(out) + "\n")
    (folder / "report.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    return Artifact("report/", "the run's report (python -m dtk.report): numbers and PNG plots", missing=missing)


def _data_lines(plan, run_dir: Path) -> list[str]:
    """Where the run's data is and which version it trained on: the version the workers
    recorded (summary.json, or a user dataset's data.json), else the dataset's own manifest."""
    from dtk.common.rundir import DATA_SPLIT

    data = plan.config.data
    recorded = _json(run_dir / SUMMARY).get("data_version") or _json(run_dir / DATA_SPLIT).get("version")
    kind = data.kind.value
    if kind == "synthetic":
        where = [f"Generated (`data=synthetic`, seed {data.seed}, {data.num_samples} samples): no files."]
    elif kind == "hdf5":
        from dtk.data.hdf5 import MANIFEST

        manifest = _json(Path(data.path).expanduser() / MANIFEST)
        tokenizer = f", tokenizer `{manifest['tokenizer']}`" if "tokenizer" in manifest else ""
        split = (f"; validation split: the shards {', '.join(manifest['val_shards'])}" if manifest.get("val_shards")
                 and not data.val_shards else "")
        relative = "" if Path(data.path).expanduser().is_absolute() else ", relative to the folder dtk.submit ran in"
        where = [f"The dataset folder `{data.path}`{relative} (`data=hdf5`{tokenizer}, python -m dtk.data prepare){split};"
                 " it must be at that path, on storage every node sees, or `data.path=` names its new place."]
        recorded = recorded or (f"{manifest['version']} (the folder's manifest today; the run recorded none)"
                                if "version" in manifest else None)
    else:
        kwargs = json.dumps(dict(data.kwargs), sort_keys=True)
        where = [f"The project's data function `{data._target_}` with the arguments `{kwargs}` (`data=user`);"
                 " it reads whatever those arguments name, so the same files must be there."]
    return where + ["", f"Version: `{recorded}`." if recorded else
                    "Version: not recorded (the run has not trained yet); a resume on other data is refused."]


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _readme(plan, run_dir: Path, made: list[Artifact]) -> str:
    lines = [f"# Handover of run {plan.run_name}", "",
             f"From `{run_dir.resolve()}` (config hash `{plan.config_hash}`), made by `python -m dtk.handover`.", "",
             "| file | what | |", "| --- | --- | --- |"]
    lines += [f"| `{a.name}` | {a.what} | {'MISSING: ' + a.missing if a.missing else 'ok'} |" for a in made]
    lines += ["", "## The data", "", *_data_lines(plan, run_dir)]
    lines += ["", "## Repeating the run", ""]
    over = next((a for a in made if a.name == "config/overrides.txt"), None)
    if over is not None and over.missing is None and plan.import_path:
        lines += ["The run is of a project of its own (project.txt: its folder and the git commit of its code)."
                  " From a checkout of that project at that commit, the same configuration (the same config"
                  " hash, so the same run name) is composed by:", "",
                  "    cd PROJECT_CHECKOUT   # the project's code, at the commit project.txt names",
                  "    python -m dtk.submit --config-dir THIS_FOLDER $(cat THIS_FOLDER/config/overrides.txt)"
                  " run.root=YOUR_RUN_ROOT", "",
                  "with this folder's `conf/` (the project's, copied). acceptance.md says how to check the"
                  " result against this run: `python -m dtk.report NEW_RUN --baseline THIS_FOLDER`."]
    elif over is not None and over.missing is None:
        lines += ["The same configuration (the same config hash, so the same run name) is composed by:", "",
                  "    python -m dtk.submit $(cat config/overrides.txt) run.root=YOUR_RUN_ROOT", "",
                  "with this dtk's `conf/`. acceptance.md says how to check the result against this run:"
                  " `python -m dtk.report NEW_RUN --baseline THIS_FOLDER`."]
    else:
        lines += ["config/config.yaml holds every key of the run; "
                  + (over.missing if over is not None and over.missing else "")]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    made = handover(args.run_dir, args.out)
    missing = [a for a in made if a.missing]
    for a in made:
        print(f"{'missing' if a.missing else 'ok':<8} {a.name}" + (f": {a.missing}" if a.missing else ""))
    print(f"{args.out}: {len(made) - len(missing)} of {len(made)} artifacts" + (
        f"; {len(missing)} missing, see {args.out / 'README.md'}" if missing else ""))
    if missing:
        print(f"incomplete: {', '.join(a.name for a in missing)}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    from dtk.access.check import explain_denied

    run_cli(main, on_denied=explain_denied)
