"""Fit a plan to the nodes a job still has: the same run on fewer nodes, or no plan."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Protocol

from dtk.common.errors import UserError
from dtk.plan.plan import Plan, make_plan


def fit_plan(plan: Plan, usable_nodes: int, *, allow_shrink: bool) -> Plan | None:
    """`plan` when enough nodes are usable; else the plan on `usable_nodes` nodes with the
    same global batch (more accumulation, or a smaller micro batch), when the scheme's
    degrees allow it; else None (the job must requeue)."""
    if usable_nodes >= plan.nodes:
        return plan
    if not allow_shrink or usable_nodes < 1:
        return None
    cfg = copy.deepcopy(plan.config)
    cfg.nodes = usable_nodes
    cfg.tasks_per_node = plan.tasks_per_node
    cfg.spare_nodes = 0
    cfg.run.root = str(Path(plan.run_dir).parent)
    cfg.run.name = plan.run_name
    # Keep the micro batch (it is what fits in memory) when it still divides the batch;
    # otherwise the largest smaller one that does.
    for micro in range(plan.micro_batch, 0, -1):
        cfg.train.micro_batch = micro
        try:
            shrunk = make_plan(cfg, import_path=plan.import_path)
        except UserError:
            continue
        assert shrunk.config_hash == plan.config_hash and shrunk.run_dir == plan.run_dir
        return shrunk
    return None


# --- growing back --------------------------------------------------------------------
GROW_POLL_S = 10.0
"""How often a driver asks Slurm (sinfo) whether nodes came back."""
HEALTH_TIMEOUT_S = 180.0
"""A health job that has not passed by then failed (the node is tried again later)."""
HEALTH_RETRY_S = 300.0
"""Pause before a node whose health job failed is tried again."""
# The one-step job a returning node runs before the run takes it back: one forward and
# backward pass on the run's device, then its heartbeat, written from the node (slurmd's
# name for it, SLURMD_NODENAME) into the run directory every node shares.
PROBE = """import json, os, sys, time, torch
dev = torch.device("cuda") if sys.argv[2] == "cuda" else torch.device("cpu")
w = torch.randn(256, 256, device=dev, requires_grad=True)
(w @ w).square().mean().backward()
assert torch.isfinite(w.grad).all()
beat = {"node": os.environ.get("SLURMD_NODENAME", ""), "time": time.time(), "device": str(dev)}
open(sys.argv[1], "w").write(json.dumps(beat))
"""


def health_command(plan: Plan, node: str, beat: Path) -> list[str]:
    """srun as a job of its own on `node` (the driver's allocation no longer holds it)."""
    import sys

    cluster = plan.config.cluster
    device = "cuda" if cluster.gpus_per_node else "cpu"
    cmd = ["srun", "--job-name=dtk-health", f"--nodelist={node}", "--nodes=1", "--ntasks=1", "--time=3",
           f"--cpus-per-task={cluster.cpus_per_task}"]
    if cluster.partition:
        cmd.append(f"--partition={cluster.partition}")
    if cluster.gpus_per_node:
        cmd.append("--gpus=1")
    return cmd + [sys.executable, "-c", PROBE, str(beat), device]


def health_env(environ: dict[str, str]) -> dict[str, str]:
    """The driver's environment without the variables that would make srun a step of the
    driver's own job (SLURM_JOB_ID and the rest); SLURM_CONF stays."""
    return {k: v for k, v in environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


class Step(Protocol):
    """A health check's job step as the driver watches it (Slurm.start_step: a Popen, or the tests' fake)."""

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...


class GrowWatch:
    """While a job runs on fewer nodes than its plan, watch for nodes to come back.

    An excluded node that Slurm reports in service again runs a health job; when it
    passes, the node is re-admitted (excluded_nodes.json says by whom, why, when). Once
    the nodes of this start plus the idle, usable nodes of the partition make the full
    count, `poll` answers with the nodes that returned: the driver then stops the workers
    at the next step boundary (they save) and requeues the job at its full size.
    """

    def __init__(self, *, run, slurm, plan: Plan, environ: dict[str, str], partition: str | None) -> None:
        self.run, self.slurm, self.plan = run, slurm, plan
        self.environ, self.partition = environ, partition
        self.next_poll = 0.0
        self.checks: dict[str, tuple[Step | None, float, Path]] = {}  # node -> (srun, started, beat file)
        self.failed_at: dict[str, float] = {}

    def due(self) -> bool:
        """Something to look at: a poll is due, or a health job is running."""
        return self.slurm.clock.time() >= self.next_poll or bool(self.checks)

    def poll(self, nodes: list[str]) -> list[str] | None:
        """None, or the usable nodes outside this start that make the full count."""
        from dtk.driver.exclusions import read_exclusions, readmit
        from dtk.launch.slurmctl import SlurmUnavailable

        now = self.slurm.clock.time()
        self._finish_checks(now)
        if now < self.next_poll:
            return None
        self.next_poll = now + GROW_POLL_S
        try:
            states = self.slurm.node_states(self.partition)
        except SlurmUnavailable:
            return None
        excluded = read_exclusions(self.run)
        for node in excluded:
            if states.get(node) == "idle" and node not in self.checks and now >= self.failed_at.get(node, 0) + HEALTH_RETRY_S:
                self._start_check(node, now)
        passed = [n for n, (proc, _, _) in self.checks.items() if proc is None]
        for node in passed:
            del self.checks[node]
            why = f"back in service ({states.get(node)}) and its health job passed"
            readmit(self.run, node, by="driver", reason=why)
            self.run.event("node_readmitted", nodes=[node], by="driver", reason=why)
        excluded = read_exclusions(self.run)
        idle = [n for n, s in states.items() if s == "idle" and n not in excluded and n not in nodes
                and n not in self.checks]
        missing = self.plan.nodes - len(nodes)
        return idle[:missing] if 0 < missing <= len(idle) else None

    def _start_check(self, node: str, now: float) -> None:
        beat = self.run.path / "health" / f"{node}.json"
        beat.parent.mkdir(exist_ok=True)
        beat.unlink(missing_ok=True)
        proc = self.slurm.start_step(health_command(self.plan, node, beat), env=health_env(self.environ))
        self.checks[node] = (proc, now, beat)

    def _finish_checks(self, now: float) -> None:
        """A finished check becomes (None, ...) when it passed; a failed one is dropped."""
        import json

        for node, (proc, started, beat) in list(self.checks.items()):
            if proc is None:
                continue
            code = proc.poll()
            if code is None and now - started < HEALTH_TIMEOUT_S:
                continue
            if code is None:
                proc.kill()
            try:
                ok = code == 0 and json.loads(beat.read_text())["node"] == node
            except (FileNotFoundError, ValueError, KeyError):
                ok = False
            if ok:
                self.checks[node] = (None, started, beat)
                self.next_poll = 0.0  # take it back at once
            else:
                del self.checks[node]
                self.failed_at[node] = now
                self.run.event("health_failed", nodes=[node], code=code)
