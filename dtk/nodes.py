"""python -m dtk.nodes RUN_DIR [--readmit NODE] [--json]: the nodes a run keeps out, and
giving one back.

A node that failed under a run is excluded from its later allocations (the driver writes
`excluded_nodes.json`; every requeue sets the job's ExcNodeList from it). This lists each
exclusion with its reason and time, and Slurm's view of the node now. `--readmit NODE`
gives the node back: safe while the run's driver is live (the file is changed under its
lock); a pending job of the run has its ExcNodeList updated at once, a running one at its
next requeue. Check first that Slurm has the node in service (`sinfo -N -n NODE -o %T`:
idle, mixed or allocated); a node down or drained is resumed by the operator, see
docs/recovery.md.

Given a run root instead (`python -m dtk.nodes RUN_ROOT [--readmit NODE|all]`), the
root's reputation (dtk/launch/reputation.py): every node its runs exclude, with those runs; the
suspect ones (excluded by cluster.suspect_after or more runs) are left out of every new
submission under the root. `--readmit` gives a suspect node back to the root: only
exclusions after it count from then on (each run keeps its own list).

A name in an exclusion list that is no node name (dtk/launch/nodenames.py) is shown
escaped and marked invalid: it is left out of every submission and counts for no node.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dtk.access.check import check_action
from dtk.common import audit
from dtk.common.errors import ArgumentParser, UserError, run_cli
from dtk.common.rundir import PLAN_JSON, READMITTED_NODES, RunDir
from dtk.driver.exclusions import check_node, read_entries, read_exclusions, readmit
from dtk.launch import reputation
from dtk.launch.nodenames import is_node_name, shown


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _slurm():
    """The real Slurm, or None where there are no Slurm commands."""
    import shutil

    from dtk.launch.slurmctl import LOGIN_RETRY_S, Slurm

    return Slurm(retry_s=LOGIN_RETRY_S) if shutil.which("sinfo") else None


def _node_states(slurm) -> dict[str, str]:
    from dtk.launch.slurmctl import SlurmUnavailable

    if slurm is None:
        return {}
    try:
        return slurm.node_states()
    except SlurmUnavailable:
        return {}


def _last_job(run: RunDir) -> str | None:
    jobs = [str(e["job_id"]) for e in run.events_list() if e.get("event") in ("submitted", "resubmitted", "started")
            and e.get("job_id")]
    jobs = [j for j in jobs if j.isdigit()]
    return jobs[-1] if jobs else None


def listing(run: RunDir, slurm=None) -> list[dict]:
    states = _node_states(slurm)
    return [dict(e, slurm_state=states.get(e["node"], "?") if is_node_name(e["node"]) else "?",
                 valid=is_node_name(e["node"])) for e in read_entries(run)]


def render(entries: list[dict]) -> str:
    now = [e for e in entries if "readmitted" not in e and e["valid"]]
    back = [e for e in entries if "readmitted" in e and e["valid"]]
    invalid = [e for e in entries if not e["valid"]]
    lines = [f"{len(now)} node(s) excluded" + (":" if now else "")]
    for e in now:
        lines.append(f"  {e['node']:<12} since {_when(e['time'])}  job {e['job_id']}  slurm: {e['slurm_state']}"
                     f"  reason: {shown(str(e['reason']))}")
    if back:
        lines.append("re-admitted:")
        for e in back:
            r = e["readmitted"]
            lines.append(f"  {e['node']:<12} excluded {_when(e['time'])} ({shown(str(e['reason']))});"
                         f" back {_when(r['time'])} by {shown(str(r['by']))}: {shown(str(r['reason']))}")
    if invalid:
        lines.append(f"{len(invalid)} invalid node name(s), left out of every submission:")
        lines += [f"  {shown(e['node'])}  job {shown(str(e.get('job_id')))}  reason: {shown(str(e.get('reason')))}"
                  for e in invalid]
    return "\n".join(lines)


def readmit_node(run: RunDir, node: str, slurm=None) -> str:
    """Give `node` back to the run; the one line that says what was done."""
    from dtk.launch.slurmctl import SlurmUnavailable

    check_node(node, flag="--readmit")
    excluded = read_exclusions(run)
    if node not in excluded:  # before readmit takes the run's exclusion lock (a file)
        raise UserError(f"--readmit {node}: the run does not exclude {node}"
                        f" (excluded now: {', '.join(sorted(excluded)) or 'none'})")
    user = audit.current_user()["name"]
    readmit(run, node, by=user, reason="dtk.nodes --readmit")
    run.event("node_readmitted", nodes=[node], by=user, reason="dtk.nodes --readmit")
    said = f"{node} re-admitted to {run.path.name}"
    job = _last_job(run)
    if slurm is None or job is None:
        return said + "; the next submission no longer excludes it"
    try:
        state = slurm.job_state(job)
        if state == "PENDING":
            refused = slurm.set_excluded(job, read_exclusions(run))
            return said + (f"; job {job} is pending and Slurm refused the update ({refused})" if refused
                           else f"; pending job {job} may now be given it")
    except SlurmUnavailable as exc:
        return said + f"; Slurm did not answer ({exc}): the next requeue or submission no longer excludes it"
    if state in ("RUNNING", "COMPLETING", "CONFIGURING"):
        return said + f"; job {job} is {state}: its next requeue no longer excludes it"
    return said + "; the next submission no longer excludes it"


def root_listing(root: Path) -> dict:
    """Every node the root's runs exclude now (since its readmission to the root), with
    those runs, and whether it is suspect."""
    after = reputation.root_threshold(root)
    exclusions = reputation.exclusions_under(root)
    counted = reputation.suspects_of(exclusions, reputation.read_readmitted(root), after=1)
    return {"suspect_after": after, "readmitted": reputation.read_readmitted(root),
            "nodes": [{"node": n, "runs": runs, "suspect": 0 < after <= len(runs)} for n, runs in counted.items()],
            "invalid": [{"node": n, "runs": runs} for n, runs in reputation.invalid_of(exclusions).items()]}


def render_root(root: Path, listed: dict) -> str:
    after = listed["suspect_after"]
    suspect = [e for e in listed["nodes"] if e["suspect"]]
    lines = [f"{len(suspect)} suspect node(s) under {root} (excluded by {after} or more runs: left out of new"
             f" submissions{'' if after else '; cluster.suspect_after=0, the rule is off'})" + (":" if suspect else "")]
    lines += [f"  {e['node']:<12} excluded by {len(e['runs'])} runs: {', '.join(e['runs'])}" for e in suspect]
    rest = [e for e in listed["nodes"] if not e["suspect"]]
    if rest:
        lines.append("excluded by fewer runs:")
        lines += [f"  {e['node']:<12} excluded by {', '.join(e['runs'])}" for e in rest]
    for node, r in sorted(listed["readmitted"].items()):
        lines.append(f"  {node:<12} re-admitted to the root {_when(r['time'])} by {shown(str(r['by']))}")
    if listed["invalid"]:
        lines.append("invalid node names (no node names: left out of every submission, never suspect):")
        lines += [f"  {e['node']}  in {', '.join(map(shown, e['runs']))}" for e in listed["invalid"]]
    return "\n".join(lines)


def readmit_to_root(root: Path, node: str) -> str:
    """Give a suspect node (or `all` of them) back to the root; the line that says so."""
    if node != "all":
        check_node(node, flag="--readmit")
    suspect = reputation.suspects(root)
    nodes = sorted(suspect) if node == "all" else [node]
    if node != "all" and node not in suspect:
        raise UserError(f"--readmit {node}: no suspect node {node} under {root}"
                        f" (suspect now: {', '.join(sorted(suspect)) or 'none'})")
    if not nodes:
        return f"no suspect node under {root}; nothing re-admitted"
    user = audit.current_user()["name"]
    reputation.readmit(root, nodes, by=user, reason="dtk.nodes --readmit")
    audit.record(root, "readmit", node=",".join(nodes), scope="run root")
    return (f"{', '.join(nodes)} re-admitted to {root}: new submissions there may use it again; only exclusions"
            " from now on count against it")


def _is_root(path: Path) -> bool:
    return path.is_dir() and bool(reputation.run_dirs(path) or (path / READMITTED_NODES).is_file())


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m dtk.nodes", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR|RUN_ROOT", type=Path)
    parser.add_argument("--readmit", metavar="NODE", help="give NODE back to the run, or to the run root (NODE or all)")
    parser.add_argument("--json", action="store_true", help="every entry as JSON")
    args = parser.parse_args(argv)
    if not (args.run_dir / PLAN_JSON).is_file() and _is_root(args.run_dir):
        root = args.run_dir
        if args.readmit:
            audit.check_writable(root)
            print(readmit_to_root(root, args.readmit))
            return 0
        listed = root_listing(root)
        print(json.dumps(listed, indent=2) if args.json else render_root(root, listed))
        return 0
    if not (args.run_dir / PLAN_JSON).is_file():
        raise UserError(f"RUN_DIR={args.run_dir}: not a dtk run directory (no plan.json), nor a run root that holds one")
    run = RunDir(args.run_dir)
    slurm = _slurm()
    if args.readmit:
        check_action(run.path, "submitter", doing=f"readmit node {args.readmit}")
        audit.check_writable(audit.run_root_of(run.path))
        said = readmit_node(run, args.readmit, slurm)
        job = _last_job(run)
        audit.record_run(run.path, "readmit", job_ids=[job] if job else [], node=args.readmit, said=said)
        print(said)
        return 0
    entries = listing(run, slurm)
    print(json.dumps(entries, indent=2) if args.json else render(entries))
    return 0


if __name__ == "__main__":
    from dtk.access.check import explain_denied

    run_cli(main, on_denied=explain_denied)
