"""dtk's own files: the config groups (`conf/`) and the Slurm templates (`slurm_templates/`).

Both are package data of `dtk`, found with importlib.resources whether dtk runs from a
checkout, an editable install or an installed wheel. In the repository they live at the
top level (where a reader looks for them) and `dtk/conf`, `dtk/slurm_templates` are
symbolic links to them; a wheel carries real copies. No code finds them by a path
relative to its own source file.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def _package_folder(name: str) -> Path:
    found = resources.files("dtk") / name
    # Hydra and the template readers want real paths. A wheel installs as plain files (dtk is
    # not zip-safe), so the resource is a folder on disk.
    if not isinstance(found, Path) or not found.is_dir():
        raise RuntimeError(f"dtk's package data {name}/ is missing from {found}; reinstall dtk (pip install .)")
    return found


def conf_dir() -> Path:
    """dtk's own config groups (cluster, model, data, optim, checkpoint, scheme, task)."""
    return _package_folder("conf")


def templates_dir() -> Path:
    """slurm.conf of the lab and the setup/*.sh lines of batch scripts."""
    return _package_folder("slurm_templates")


def project_template_dir() -> Path:
    """The starter project folder `python -m dtk.init` writes."""
    return _package_folder("project_template")
