"""python -m dtk.checkpoint {list,export}: inspect a run's checkpoints, export one.

`list` imports no torch (it runs on a login node); `export` does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dtk.common.errors import ArgumentParser, UserError, run_cli

EPILOG = """examples:
  python -m dtk.checkpoint list runs/transformer-1a2b3c4d5e
  python -m dtk.checkpoint export runs/transformer-1a2b3c4d5e --out model.pt
  python -m dtk.checkpoint export runs/transformer-1a2b3c4d5e --step 200 --out model_200.pt
  python -m dtk.checkpoint export runs/transformer-1a2b3c4d5e --format safetensors --out model.safetensors
  python -m dtk.checkpoint export runs/hf-1a2b3c4d5e --format hf --out my-llama   # from_pretrained("my-llama")
  python -m dtk.checkpoint delete runs/transformer-1a2b3c4d5e --step 100

A checkpoint is verified when its manifest.json exists, every file it lists has the
recorded size and CRC-32, and its .metadata holds DCP's metadata classes only (nothing in
a checkpoint is ever unpickled as code; docs/checkpoints.md, What is trusted). Training
resumes from the newest verified one, which `delete` refuses without --force. Exports and
deletions are recorded in the run root's audit log.
"""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m dtk.checkpoint",
        description="Inspect and export the checkpoints of a run directory.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="steps, sizes, and whether each checkpoint verifies")
    ls.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                    help="a run's folder, its checkpoints/ folder, or one step folder in it (that checkpoint only)")
    ls.add_argument("--no-checksums", action="store_true", help="check sizes only (reads no checkpoint data)")
    ls.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    ex = sub.add_parser("export", help="one consolidated model (a state dict file, or a Hugging Face folder) from a checkpoint")
    ex.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                    help="a run's folder, its checkpoints/ folder, or one step folder in it (that step)")
    ex.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest that verifies)")
    ex.add_argument("--out", required=True, type=Path,
                    help="the file (or, with --format hf, the folder) to write; OUT.json gets where it came from")
    ex.add_argument("--format", dest="fmt", default="torch", choices=["torch", "safetensors", "hf"],
                    help="torch: torch.save'd state dict (default); safetensors: the same as safetensors;"
                         " hf: a folder AutoModelForCausalLM.from_pretrained loads (runs of model=hf)")
    rm = sub.add_parser("delete", help="delete one checkpoint folder (recorded in the audit log)")
    rm.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                    help="a run's folder, its checkpoints/ folder, or one step folder in it (that step)")
    rm.add_argument("--step", type=int, required=True, help="the checkpoint's step")
    rm.add_argument("--force", action="store_true",
                    help="also delete the newest verified checkpoint (the one a resume would start from)")
    return p


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def located(path: Path) -> tuple[Path, int | None]:
    """(the run directory, the one step asked for or None) from what a user typed: the run's
    folder, its checkpoints/ folder, or one step_NNNNNNNN folder in it."""
    from dtk.common.rundir import CHECKPOINT_DIR_RE, CHECKPOINTS_DIR

    m = CHECKPOINT_DIR_RE.match(path.name)
    if m and path.parent.name == CHECKPOINTS_DIR:
        return path.parent.parent, int(m.group(1))
    if path.name == CHECKPOINTS_DIR and not (path / CHECKPOINTS_DIR).is_dir():
        return path.parent, None
    return path, None


def list_command(path: Path, *, checksums: bool, as_json: bool) -> int:
    from dtk.checkpoint.manifest import list_checkpoints
    from dtk.common.rundir import RunDir
    from dtk.common.storage import StoreUnreachable, checkpoints_of

    if not path.is_dir():
        raise UserError(f"RUN_DIR {path}: no such run directory")
    run_dir, step = located(path)
    run = RunDir(run_dir)
    if not run.checkpoints.is_dir() and not run.plan_json.is_file():
        raise UserError(f"RUN_DIR {path}: not a run directory (no {run.checkpoints.name}/ folder, no"
                        f" {run.plan_json.name}); give a run's folder (runs/NAME), its {run.checkpoints.name}/ folder,"
                        " or one step folder in it")
    store = checkpoints_of(run)  # checkpoint.dir: the run's checkpoints/ folder, or an object store
    try:
        found = [c for c in list_checkpoints(store, checksums=checksums) if step is None or c.step == step]
    except StoreUnreachable as exc:  # an object store's endpoint or credentials (the AWS_* variables)
        raise UserError(f"RUN_DIR {path}: {exc}; check AWS_ENDPOINT_URL_S3 and the AWS credentials") from None
    if as_json:
        for c in found:
            m = c.manifest or {}
            print(json.dumps({"step": c.step, "path": str(c.path), "bytes": c.size, "committed": c.committed,
                              "verified": c.verified, "reason": c.reason, "world_size": m.get("world_size"),
                              "scheme": m.get("scheme"), "save_seconds": m.get("save_seconds")}))
        return 0
    if not found:
        print(f"no checkpoints in {store}")
        return 0
    what = "verified" if checksums else "sizes ok"
    print(f"{'step':>10}  {'size':>9}  {'world':>5}  {what}")
    for c in found:
        m = c.manifest or {}
        status = "yes" if c.verified else f"NO: {c.reason}"
        print(f"{c.step:>10}  {human(c.size):>9}  {m.get('world_size', '-'):>5}  {status}")
    return 0


def _run_and_step(path: Path, step: int | None) -> tuple[Path, int | None]:
    """export and delete take the folders list takes: a step folder names its step, which
    --step may repeat but not contradict."""
    run_dir, folder_step = located(path)
    if folder_step is not None and step not in (None, folder_step):
        raise UserError(f"RUN_DIR {path} is the folder of step {folder_step}, but --step {step} names another;"
                        f" give the run's folder with --step {step}, or leave --step out")
    return run_dir, step if step is not None else folder_step


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "list":
        return list_command(args.run_dir, checksums=not args.no_checksums, as_json=args.json)
    from dtk.access.check import check_action
    from dtk.common import audit

    args.run_dir, args.step = _run_and_step(args.run_dir, args.step)
    if args.command == "delete":
        check_action(args.run_dir, "maintainer", doing="delete checkpoints")
    else:
        check_action(args.run_dir, "viewer", doing="export a checkpoint")
    audit.check_writable(audit.run_root_of(args.run_dir))
    if args.command == "delete":
        from dtk.checkpoint.delete import delete_checkpoint

        print(delete_checkpoint(args.run_dir, step=args.step, force=args.force))
        return 0
    from dtk.checkpoint.export import export

    info = export(args.run_dir, out=args.out, step=args.step, fmt=args.fmt)
    audit.record_run(args.run_dir, "export", step=info["step"], out=str(Path(args.out).resolve()))
    print(f"{args.out}: step {info['step']}, {info['tensors']} tensors, {info['parameters']} parameters ({human(info['bytes'])})")
    return 0


if __name__ == "__main__":
    from dtk.access.check import explain_denied

    run_cli(main, on_denied=explain_denied)
