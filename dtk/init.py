"""python -m dtk.init DIR: a project folder of the user's own, which dtk finds when it runs there.

    DIR/
        README.md                   the three commands: train here, on Slurm, follow a run
        .gitignore                  data/ and runs/
        MODULE.py                   the model (plain PyTorch)
        conf/project/default.yaml   this project's default choices of dtk's groups
        conf/model/MODULE.yaml      the model's factory and keyword arguments
        conf/data/MODULE.yaml       the training data
        conf/cluster/site.yaml      the site's Slurm resources, from dtk's Slurm template

Every dtk command run in DIR (or given `--config-dir DIR`, or with DIR in
`$DTK_CONFIG_PATH`) searches DIR/conf before dtk's own groups and puts DIR on the import
path of the submitting process and of every worker. No torch here: it runs on a login node.
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import os
import re
import sys
from pathlib import Path

from dtk.common.errors import ArgumentParser, UserError, check_out, run_cli
from dtk.common.resources import conf_dir, project_template_dir

PLACEHOLDER = "__MODULE__"
# Template names that become other names in the project folder.
RENAMES = {"gitignore": ".gitignore", "module.py.tmpl": f"{PLACEHOLDER}.py", "MODULE.yaml": f"{PLACEHOLDER}.yaml"}


def _importable_elsewhere(name: str, folder: Path) -> bool:
    """Whether `name` imports from somewhere other than the current folder or the new
    project's parent (an empty `DIR` there would look like a namespace package)."""
    local = {Path.cwd().resolve(), folder.parent}
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() not in local]
    try:
        return importlib.util.find_spec(name) is not None
    finally:
        sys.path[:] = saved


def module_name(folder: Path, requested: str | None) -> str:
    """The project's Python module: `--name`, else the folder's name made an identifier.
    It must not shadow a module that is already importable (the workers import it by name)."""
    name = requested or re.sub(r"\W", "_", folder.name.lower()).strip("_")
    key = "--name" if requested else f"DIR {folder}"
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UserError(f"{key}: {name!r} is not a Python module name; give one with --name NAME (letters, digits, _)")
    if _importable_elsewhere(name, folder):
        raise UserError(
            f"{key}: a module named {name!r} is already importable here, and the project's module would"
            " shadow it or be shadowed; give another with --name NAME"
        )
    return name


def site_yaml() -> str:
    """dtk's generic Slurm cluster file with a header for the site that fills it in."""
    body = (conf_dir() / "cluster" / "slurm.yaml").read_text().splitlines()
    while body and body[0].startswith("#"):
        body.pop(0)
    header = [
        "# This site's Slurm cluster: python -m dtk.submit cluster=site ...",
        "# Fill in the partition, account, GPUs and CPUs per node, memory and time limit;",
        "# python -m dtk.submit cluster=site submit.dry_run=true prints the sbatch script.",
        "# `setup` names files in dtk's slurm_templates/setup/ (module loads, NCCL environment).",
    ]
    return "\n".join(header + body) + "\n"


def render(module: str, title: str) -> dict[Path, str]:
    """{path inside the project folder: text} of every file init writes."""
    files: dict[Path, str] = {}
    template = project_template_dir()
    for src in sorted(template.rglob("*")):
        if not src.is_file() or "__pycache__" in src.parts:
            continue
        rel = src.relative_to(template)
        rel = rel.with_name(RENAMES.get(rel.name, rel.name).replace(PLACEHOLDER, module))
        files[rel] = src.read_text().replace(PLACEHOLDER, module).replace("__NAME__", title)
    files[Path("conf/cluster/site.yaml")] = site_yaml()
    return files


def init(folder: Path, *, name: str | None = None) -> list[Path]:
    """Write the starter project into `folder` (new, or empty). All files or none."""
    folder = check_out(folder.expanduser().resolve(), folder=True, flag="DIR")
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UserError(f"DIR {folder}: exists and is not an empty folder; choose a new folder")
    module = module_name(folder, name)
    files = render(module, folder.name)
    tmp = folder.with_name(f".{folder.name}.init{os.getpid()}")
    try:
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
        if folder.exists():
            folder.rmdir()  # empty, checked above
        tmp.rename(folder)
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return [folder / rel for rel in files]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m dtk.init",
        description="Write a project folder of your own: a model module, config groups that dtk"
        " searches before its own, and a cluster file for your Slurm site.",
        epilog="example: python -m dtk.init myproject && cd myproject && python -m dtk.submit",
    )
    p.add_argument("dir", metavar="DIR", type=Path, help="the folder to create (new, or empty)")
    p.add_argument("--name", default=None, help="the project's Python module (default: from the folder's name)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    written = init(args.dir, name=args.name)
    root = args.dir.expanduser().resolve()
    print(f"wrote {len(written)} files to {root}:")
    for path in sorted(written):
        print(f"  {path.relative_to(root)}")
    print(f"next: cd {args.dir} && python -m dtk.submit")
    return 0


if __name__ == "__main__":
    run_cli(main)
