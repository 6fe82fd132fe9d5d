"""python -m dtk.doctor [overrides]: a short job on the chosen cluster that measures the
fabric (per node topology, all-reduce per process group, p2p between nodes, matmul per
device), flags slow nodes and writes report.md and exclude.txt. No torch here."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dtk.common.errors import ArgumentParser, UserError, run_cli
from dtk.config.compose import compose
from dtk.launch.launch import check_run_root, read_exclude_file
from dtk.plan.plan import DEFAULT_CPU_TASKS

# Slurm job states before the end (squeue's long names).
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "STAGE_OUT")

EPILOG = """examples:
  python -m dtk.doctor                              2 ranks on this machine
  python -m dtk.doctor cluster=lab nodes=3 tasks_per_node=1
  python -m dtk.submit cluster=lab cluster.exclude_from=runs/doctor-.../exclude.txt

The sweep sizes, repeats and the slow-node factor are the doctor.* keys (python -m dtk.plan --help).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m dtk.doctor", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Measure the fabric of a cluster with a short job: each node's topology, an"
                                        " all-reduce sweep per process group (time, algbw, busbw), point-to-point"
                                        " bandwidth between nodes, matmul throughput per device; flag nodes slower"
                                        " than the median and write the list dtk.submit cluster.exclude_from= reads.")
    parser.add_overrides()
    return parser


def request(cfg, *, gpus: bool) -> dict:
    doc = cfg.doctor
    cap = doc.max_mb if gpus else min(doc.max_mb, doc.max_mb_cpu)
    if doc.min_mb <= 0 or doc.min_mb > cap:
        raise UserError(f"doctor.min_mb={doc.min_mb:g}: must be > 0 and <= the largest size {cap:g} MB"
                        f" (doctor.max_mb{'' if gpus else ' / doctor.max_mb_cpu'})")
    if not doc.p2p_mb > 0:
        raise UserError(f"doctor.p2p_mb={doc.p2p_mb:g}: expected a positive message size in MB")
    if doc.repeats < 1 or doc.slow_factor <= 1 or doc.matmul_n < 1:
        raise UserError(f"doctor.repeats={doc.repeats}, doctor.slow_factor={doc.slow_factor:g},"
                        f" doctor.matmul_n={doc.matmul_n}: need repeats >= 1, slow_factor > 1, matmul_n >= 1")
    sizes, size = [], doc.min_mb
    while size <= cap * (1 + 1e-9):
        sizes.append(size)
        size *= 4
    return {"sizes_mb": sizes, "repeats": doc.repeats, "p2p_mb": min(doc.p2p_mb, cap), "matmul_n": doc.matmul_n,
            "slow_factor": doc.slow_factor, "backend": cfg.dist.backend.value, "device": cfg.dist.device.value,
            "timeout_s": cfg.dist.timeout_s, "startup_timeout_s": cfg.fault.startup_timeout_s,
            "cluster_env": {k: str(v) for k, v in cfg.cluster.env.items()}}


def sbatch_script(cfg, *, out: Path, nodes: int, tasks: int, exclude: tuple[str, ...]) -> str:
    c = cfg.cluster
    flags = ["--job-name=dtk-doctor", f"--nodes={nodes}", f"--ntasks-per-node={tasks}",
             f"--cpus-per-task={c.cpus_per_task}", f"--time={min(c.time_min, 30)}", f"--output={out}/slurm-%j.out"]
    for name, value in (("partition", c.partition), ("account", c.account), ("qos", c.qos),
                        ("constraint", c.constraint)):
        if value:
            flags.append(f"--{name}={value}")
    if c.gpus_per_node:
        flags.append(f"--gpus-per-node={c.gpus_per_node}")
    if c.exclusive:
        flags.append("--exclusive")
    if exclude:
        flags.append(f"--exclude={','.join(exclude)}")
    lines = ["#!/bin/bash", *(f"#SBATCH {f}" for f in flags),
             # rank 0's rendezvous port, from the job id: two doctors on one host do not collide
             "export DTK_MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
             f"srun --kill-on-bad-exit=1 --output={shlex.quote(str(out))}/rank_%t.log {shlex.quote(sys.executable)}"
             f" -m dtk.doctor.worker {shlex.quote(str(out))}"]
    return "\n".join(lines) + "\n"


def _wait_for_job(job_id: str) -> int:
    """0 once the job completed, 1 if it ended otherwise. Polled every half second: `sbatch
    --wait` doubles its pause up to 32 s, which kept a 10 s doctor job waiting half a minute."""
    from dtk.launch.slurmctl import Slurm

    slurm = Slurm()
    while (state := slurm.job_state(job_id)) in ACTIVE:
        time.sleep(0.5)
    return 0 if state in ("COMPLETED", None) else 1


def _run_local(out: Path, world: int) -> int:
    from dtk.driver.local import free_port
    from dtk.worker.env import driver_env, rank_env

    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ) | rank_env(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                                          node_rank=0)
        env |= driver_env(master_addr="127.0.0.1", master_port=port, restart=0, plan="", recovery_from=None)
        with open(out / f"rank_{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "dtk.doctor.worker", str(out)], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    return max(p.wait() for p in procs)


def _new_folder(root: Path, name: str) -> Path:
    """root/name, or root/name-2, ... when another doctor started in the same second."""
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        out = root / (name if n == 1 else f"{name}-{n}")
        try:
            out.mkdir()
            return out
        except FileExistsError:
            continue
    raise UserError(f"run.root={root}: {name} and 999 more doctor folders of this second exist; remove some")


def main(argv: list[str]) -> int:
    args = build_parser().parse_intermixed_args(argv)
    cfg = compose(args.overrides)
    slurm = cfg.cluster.kind.value == "slurm"
    if not slurm and cfg.nodes != 1:
        raise UserError(f"nodes={cfg.nodes}: the local cluster is this one machine; use cluster=lab or cluster=slurm")
    tasks = cfg.tasks_per_node if cfg.tasks_per_node is not None else (cfg.cluster.gpus_per_node or DEFAULT_CPU_TASKS)
    if cfg.nodes < 1 or tasks < 1:
        raise UserError(f"nodes={cfg.nodes} tasks_per_node={tasks}: expected positive counts")
    req = request(cfg, gpus=bool(cfg.cluster.gpus_per_node))
    exclude = read_exclude_file(cfg.cluster.exclude_from) if slurm else ()
    root = Path(cfg.run.root).absolute()
    check_run_root(root)
    outermost = next((p for p in (root, *root.parents) if p.parent.exists()), root)
    made = outermost if not outermost.exists() else None  # what a refusal removes
    out = _new_folder(root, f"doctor-{time.strftime('%Y%m%d-%H%M%S')}")
    (out / "request.json").write_text(json.dumps(req, indent=1) + "\n")
    said = (f"doctor: {cfg.nodes} node(s) x {tasks} rank(s), all-reduce {req['sizes_mb'][0]:g}-{req['sizes_mb'][-1]:g}"
            f" MB; output in {out}")
    if slurm:
        script = out / "doctor.sbatch"
        script.write_text(sbatch_script(cfg, out=out, nodes=cfg.nodes, tasks=tasks, exclude=exclude))
        proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        if proc.returncode:
            shutil.rmtree(made or out, ignore_errors=True)  # a refused job leaves no folder behind
            raise UserError(f"sbatch refused the doctor's job: {' '.join(proc.stderr.split())}")
        print(said, flush=True)
        code = _wait_for_job(proc.stdout.strip().split(";")[0])
    else:
        print(said, flush=True)
        code = _run_local(out, tasks)
    if code or not (out / "doctor.json").exists():
        logs = sorted(out.glob("rank_*.log"))
        tail = next((ln for log in logs for ln in reversed(log.read_text(errors="replace").splitlines())
                     if "Error" in ln), "")
        raise UserError(f"the doctor's job failed (exit {code}); {tail.strip()[:300] or 'see the rank logs'} in {out}")
    results = json.loads((out / "doctor.json").read_text())
    for g in results["groups"]:
        last = g["rows"][-1]
        print(f"  all-reduce {g['group']:<36} {last['size_mb']:>6g} MB  {last['time_ms']:9.2f} ms"
              f"  busbw {last['busbw_gbs']:.3f} GB/s")
    for f in results["flagged"]:
        print(f"  slow node {f['node']}: {f['why']}")
    print(f"report   {out / 'report.md'}\nexclude  {out / 'exclude.txt'} ({len(results['flagged'])} node(s))")
    return 0


if __name__ == "__main__":
    run_cli(main)
