"""The Python half of benchmarks/gpu_check.sh's preflight, standard library only (it must run
where dtk's dependencies do not import): one line per missing piece on stdout, nothing else.

    python benchmarks/gpu_preflight.py

- each of dtk's dependencies (pyproject.toml) and dtk itself imports;
- Python.h is where Triton looks for it (the running interpreter's include folder, which
  torch.compile's GPU kernels are built against).
"""

from __future__ import annotations

import importlib
import sys
import sysconfig
from pathlib import Path

MODULES = ("torch", "submitit", "hydra", "omegaconf", "h5py", "psutil", "numpy", "dtk")


def missing() -> list[str]:
    lines = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the import's own reason, first line
            reason = str(exc).splitlines()[0] if str(exc) else ""
            lines.append(f"gpu_check needs dtk's dependency {name}: it does not import ({type(exc).__name__}: {reason})")
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        lines.append(f"gpu_check needs Python.h for Triton (torch.compile): not in {include} (install the Python"
                     " development headers, e.g. python3-dev)")
    return lines


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dtk from this checkout
    for line in missing():
        print(line)
