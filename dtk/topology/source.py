"""The one seam through which discovery reads the machine: files, directory listings,
command outputs and environment variables.

`LiveSource` reads this node. `RecordedSource` reads a recorded machine, a folder laid out
like the paths it stands for, so discovery is tested against what real nodes showed:

    <machine>/fs/sys/class/infiniband/mlx5_0/ports/1/state     a file, verbatim
    <machine>/fs/sys/class/net/ib0/.keep                       a directory read only by listing
    <machine>/cmd/nvidia-smi_topo_-m.txt                       stdout of `nvidia-smi topo -m`
    <machine>/env.json                                         the variables discovery asked for

A file that is absent, or that the kernel refused to read (`speed` of a link that is down
raises EINVAL), is simply missing; a command that is absent or failed has no file.
Symbolic links of sysfs (`/sys/class/net/eth0 -> ../../devices/...`) are recorded as the
paths discovery walked, not as links. `RecordingSource` writes such a folder from a live
node (`python -m dtk.topology record DIR`).

No torch here: the driver and the login node discover too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Protocol

COMMAND_TIMEOUT_S = 20
KEEP = ".keep"


class Source(Protocol):
    def read(self, path: str) -> str | None:
        """The text of a file, or None when it is absent or unreadable."""

    def listdir(self, path: str) -> list[str]:
        """Sorted names in a directory; empty when it is absent."""

    def run(self, argv: list[str]) -> str | None:
        """stdout of a command, or None when the program is absent or failed."""

    def env(self, name: str) -> str | None:
        """An environment variable of the process that discovers."""


def command_key(argv: list[str]) -> str:
    """File name of a recorded command: `nvidia-smi topo -m` -> `nvidia-smi_topo_-m.txt`."""
    return re.sub(r"[^A-Za-z0-9_.=,-]", "_", "_".join(argv)) + ".txt"


class LiveSource:
    """This node, as it is now."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ

    def read(self, path: str) -> str | None:
        try:
            return Path(path).read_text(errors="replace")
        except OSError:  # absent, or EINVAL from sysfs (the speed of a link that is down)
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError:
            return []

    def run(self, argv: list[str]) -> str | None:
        if shutil.which(argv[0], path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            return None
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout if proc.returncode == 0 else None

    def env(self, name: str) -> str | None:
        return self._environ.get(name)


class RecordedSource:
    """A recorded machine. Several folders may be layered: the first that has a path wins
    (a recorded node plus, say, a recorded NCCL log from the same machine)."""

    def __init__(self, *roots: str | Path) -> None:
        assert roots, "a recorded source needs at least one folder"
        self.roots = [Path(r) for r in roots]
        missing = [str(r) for r in self.roots if not r.is_dir()]
        if missing:
            raise FileNotFoundError(f"no recorded machine at {', '.join(missing)}")

    def _fs(self, path: str) -> list[Path]:
        return [root / "fs" / path.lstrip("/") for root in self.roots]

    def read(self, path: str) -> str | None:
        for candidate in self._fs(path):
            if candidate.is_file():
                return candidate.read_text()
        return None

    def listdir(self, path: str) -> list[str]:
        for candidate in self._fs(path):
            if candidate.is_dir():
                return sorted(name for name in os.listdir(candidate) if name != KEEP)
        return []

    def run(self, argv: list[str]) -> str | None:
        for root in self.roots:
            candidate = root / "cmd" / command_key(argv)
            if candidate.is_file():
                return candidate.read_text()
        return None

    def env(self, name: str) -> str | None:
        for root in self.roots:
            try:
                values = json.loads((root / "env.json").read_text())
            except FileNotFoundError:
                continue
            if name in values:
                return values[name]
        return None


class RecordingSource:
    """Reads through another source and writes what it read as a recorded machine."""

    def __init__(self, inner: Source, out: str | Path) -> None:
        self.inner = inner
        self.out = Path(out)
        self._env: dict[str, str] = {}

    def _fs(self, path: str) -> Path:
        return self.out / "fs" / path.lstrip("/")

    def read(self, path: str) -> str | None:
        text = self.inner.read(path)
        if text is not None:
            target = self._fs(path)
            if target.is_dir():  # listed before it was read: a placeholder, not a folder
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            (target.parent / KEEP).unlink(missing_ok=True)  # the folder has content now
        return text

    def listdir(self, path: str) -> list[str]:
        names = self.inner.listdir(path)
        if names:
            folder = self._fs(path)
            for name in names:  # every listed entry exists in the recording
                entry = folder / name
                if not entry.exists():
                    entry.mkdir(parents=True)
                    (entry / KEEP).write_text("")
        return names

    def run(self, argv: list[str]) -> str | None:
        text = self.inner.run(argv)
        if text is not None:
            target = self.out / "cmd" / command_key(argv)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        return text

    def env(self, name: str) -> str | None:
        value = self.inner.env(name)
        if value is not None:
            self._env[name] = value
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "env.json").write_text(json.dumps(self._env, indent=1, sort_keys=True) + "\n")
        return value
