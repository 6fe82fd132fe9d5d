"""Module paths of earlier releases, resolved to where the code lives now.

A job queued by an earlier release runs this release's code from pickles that name what they
call by module path: submitit pickles the batch script's entry point
(`dtk.driver.supervisor.drive`) with its arguments, and a pickle may name any module that
moved. `install()` (run by dtk/__init__.py) puts a finder first on `sys.meta_path` that
imports an old name as its new module, so `pickle.loads` of `dtk.rundir.RunDir` gives
`dtk.common.rundir.RunDir`. A name that left its module (SYMBOLS) is found where it went.

MOVED is the one list of the moves (the reorganisation's, made by its script, and each
later one: dtk.checkpoint.storage became dtk.common.storage when the driver, which may not
import dtk.checkpoint, came to read the checkpoint store); a package's submodules follow it
by prefix (`dtk.dist.X` -> `dtk.mesh.X`). The commands that became packages (dtk.submit,
dtk.drill, dtk.bench) keep their names, so they are not here.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

MOVED: dict[str, str] = {
    "dtk.audit": "dtk.common.audit",
    "dtk.bench_matmul": "dtk.bench.matmul",
    "dtk.checkpoint.memory_load": "dtk.checkpoint.memory.load",
    "dtk.checkpoint.memory_root": "dtk.checkpoint.memory.root",
    "dtk.checkpoint.memory_store": "dtk.checkpoint.memory.store",
    "dtk.checkpoint.memory_tier": "dtk.checkpoint.memory.tier",
    "dtk.checkpoint.storage": "dtk.common.storage",
    "dtk.dist": "dtk.mesh",
    "dtk.dist.groups": "dtk.mesh.groups",
    "dtk.dist.host": "dtk.mesh.host",
    "dtk.dist.init": "dtk.mesh.init",
    "dtk.dist.mesh": "dtk.mesh.mesh",
    "dtk.drill_storage": "dtk.drill.storage",
    "dtk.errors": "dtk.common.errors",
    "dtk.plan.activations": "dtk.plan.cost.activations",
    "dtk.plan.budget": "dtk.plan.cost.budget",
    "dtk.plan.comm": "dtk.plan.cost.comm",
    "dtk.plan.exchange": "dtk.plan.cost.exchange",
    "dtk.plan.gate": "dtk.plan.cost.gate",
    "dtk.plan.handout": "dtk.plan.cost.handout",
    "dtk.plan.inputs": "dtk.plan.cost.inputs",
    "dtk.plan.memory": "dtk.plan.cost.memory",
    "dtk.plan.predict": "dtk.plan.cost.predict",
    "dtk.plan.report": "dtk.plan.cost.report",
    "dtk.plan.search": "dtk.plan.cost.search",
    "dtk.plan.splits": "dtk.plan.cost.splits",
    "dtk.plan.steptime": "dtk.plan.cost.steptime",
    "dtk.plan.variants": "dtk.plan.cost.variants",
    "dtk.plan.whatif": "dtk.plan.cost.whatif",
    "dtk.resources": "dtk.common.resources",
    "dtk.rundir": "dtk.common.rundir",
    "dtk.start": "dtk.submit.start",
}
"""Old module -> the module it is now (a package: its submodules follow by prefix)."""

SYMBOLS: dict[str, str] = {
    "dtk.rundir._start_ticks": "dtk.common.processes",
    "dtk.rundir.driver_alive": "dtk.common.processes",
    "dtk.rundir.pid_alive": "dtk.common.processes",
    "dtk.rundir.process_age": "dtk.common.processes",
    "dtk.rundir.process_identity": "dtk.common.processes",
    "dtk.rundir.process_start": "dtk.common.processes",
    "dtk.rundir.same_start": "dtk.common.processes",
}
"""Old module.name -> the module that name lives in now, where it left its module."""


def new_name(old: str) -> str | None:
    """The module an old module name is now, or None when it did not move."""
    if old in MOVED:
        return MOVED[old]
    for prefix, new in MOVED.items():
        if old.startswith(prefix + "."):
            return new + old[len(prefix):]
    return None


class _Moved(types.ModuleType):
    """An old module name: each attribute read is answered by the module the name lives in now
    (SYMBOLS), else by the module the old one became. A stand-in, not the new module itself,
    so that importing an old name leaves the new module's own `__spec__` as it is."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(old)
        self.__dict__["_dtk_new"] = new

    def __getattr__(self, attr: str) -> object:
        home = SYMBOLS.get(f"{self.__name__}.{attr}", self.__dict__["_dtk_new"])
        return getattr(importlib.import_module(home), attr)


class _Loader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        importlib.import_module(self.new)  # an old name of a module that fails to import fails here
        return _Moved(spec.name, self.new)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(new))


_FINDER = _Finder()


def install() -> None:
    """The finder, first on sys.meta_path (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
