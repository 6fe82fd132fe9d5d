"""python -m dtk.handover RUN_DIR --out DIR: the folder a team operates a setup by.

Everything is copied or generated from the run directory and this checkout of dtk:

    README.md            what each file is, and the command that repeats the run
    config/              the run's resolved config.yaml and plan.json; overrides.txt, the
                         command-line overrides that compose the same config (checked: same hash)
    plan.txt             the plan: world size, degrees, batch arithmetic (python -m dtk.plan)
    plan.md              the topology scheme dtk.submit wrote into the run (marked missing for an older run)
    access.md            the access policy: roles, groups, members, what each may do
    recovery.md, operations.md, acceptance.md, reference.md, access-guide.md   from docs/
    report/              the run's report (report.txt, report.json) with its PNG plots
    status.json, audit.txt   where the run stands; who did what to it

Exit code 0 when every artifact is there, 1 when the folder was written with some marked
missing in README.md (each says why), 2 for a user mistake (nothing written).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from dtk import audit
from dtk.errors import ArgumentParser, UserError, check_out, run_cli
from dtk.rundir import RunDir

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
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty folder; name a new one")
    plan = Plan.read(run)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "config").mkdir(parents=True)
    try:
        made = _write(run_dir, plan, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return made


def _write(run_dir: Path, plan, tmp: Path) -> list[Artifact]:
    made: list[Artifact] = []
    shutil.copyfile(run_dir / "config.yaml", tmp / "config" / "config.yaml")
    shutil.copyfile(run_dir / "plan.json", tmp / "config" / "plan.json")
    made.append(Artifact("config/config.yaml, config/plan.json", "the run's resolved configuration and plan"))
    made.append(_overrides(plan, tmp))
    (tmp / "plan.txt").write_text(plan.describe() + "\n")
    made.append(Artifact("plan.txt", "the plan: world size, parallel degrees, batch arithmetic"))
    made.append(_plan_md(run_dir, tmp))
    made.append(_access(plan, tmp))
    for name, source in DOCS.items():
        made.append(_doc(name, source, tmp))
    made.append(_report(run_dir, tmp))
    from dtk.rundir import RunDir
    from dtk.status import collect

    (tmp / "status.json").write_text(json.dumps(collect(RunDir(run_dir)), indent=2, default=str) + "\n")
    made.append(Artifact("status.json", "where the run stands: state, step, checkpoints, starts (python -m dtk.status)"))
    entries = audit.read(audit.run_root_of(run_dir), run=plan.run_name)
    (tmp / "audit.txt").write_text("".join(audit.describe(e) + "\n" for e in entries) or "no audit entries\n")
    made.append(Artifact("audit.txt", "who submitted, drilled, exported or deleted what (the run root's audit.jsonl)"))
    (tmp / "README.md").write_text(_readme(plan, run_dir, made))
    return made


def _overrides(plan, tmp: Path) -> Artifact:
    from dtk.config.overrides import repeat_overrides

    name = "config/overrides.txt"
    overrides, why = repeat_overrides(plan.config, plan.config_hash)
    if overrides is None:
        return Artifact(name, "command-line overrides that compose the same config", missing=why)
    (tmp / name).write_text("".join(f"{o}\n" for o in overrides))
    return Artifact(name, "the command-line overrides that compose this run's config (same config hash)")


def _plan_md(run_dir: Path, tmp: Path) -> Artifact:
    what = "the topology scheme: mesh, rank -> node placement, memory, traffic per axis, how to expand"
    if (run_dir / "plan.md").is_file() and (run_dir / "plan.md").stat().st_size:
        shutil.copyfile(run_dir / "plan.md", tmp / "plan.md")
        return Artifact("plan.md", what)
    return Artifact("plan.md", what, missing="the run directory has no plan.md (dtk.submit writes it; a run submitted"
                    " by an older dtk has none): python -m dtk.plan with the overrides in config/overrides.txt prints"
                    " the same budget; plan.txt has the plan")


def _access(plan, tmp: Path) -> Artifact:
    from dtk.access.__main__ import render

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
    from dtk.report.__main__ import build_parser as report_parser
    from dtk.report.__main__ import render, report

    folder = tmp / "report"
    folder.mkdir()
    missing = None
    try:
        out = report(report_parser().parse_args([str(run_dir), "--out", str(folder)]))
    except UserError as exc:  # plots need matplotlib; the numbers do not
        out = report(report_parser().parse_args([str(run_dir), "--no-plots"]))
        missing = f"the plots: {exc}"
    (folder / "report.txt").write_text(render(out) + "\n")
    (folder / "report.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    return Artifact("report/", "the run's report (python -m dtk.report): numbers and PNG plots", missing=missing)


def _readme(plan, run_dir: Path, made: list[Artifact]) -> str:
    lines = [f"# Handover of run {plan.run_name}", "",
             f"From `{run_dir.resolve()}` (config hash `{plan.config_hash}`), made by `python -m dtk.handover`.", "",
             "| file | what | |", "| --- | --- | --- |"]
    lines += [f"| `{a.name}` | {a.what} | {'MISSING: ' + a.missing if a.missing else 'ok'} |" for a in made]
    lines += ["", "## Repeating the run", ""]
    over = next((a for a in made if a.name == "config/overrides.txt"), None)
    if over is not None and over.missing is None:
        lines += ["The same configuration (the same config hash, so the same run name) is composed by:", "",
                  "    python -m dtk.submit $(cat config/overrides.txt) run.root=YOUR_RUN_ROOT", "",
                  "with this dtk's `conf/`. acceptance.md says how to check the result against this run."]
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
    run_cli(main)
