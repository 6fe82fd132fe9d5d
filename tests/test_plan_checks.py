"""The config's checks are one `check_<section>` per schema section (dtk/plan/checks.py),
called from one place, `check_config`, in the schema's order: first the sections checked on
their own values, then, once the degrees are resolved (`check_batch`), those checked on the
mesh (task, scheme, sync)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from dtk.config.schema import Config
from dtk.plan import checks

TOP_LEVEL = {"nodes", "spare_nodes", "tasks_per_node"}  # Config's own keys: check_job's


def _called() -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(checks.check_config)))
    return [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id.startswith("check_")]


def _section(name: str) -> str:
    return name.removeprefix("check_").removesuffix("_section")


def test_each_section_is_checked_once_in_the_schemas_order():
    order = ["job" if f.name in TOP_LEVEL else f.name for f in dataclasses.fields(Config)]
    order = list(dict.fromkeys(order))  # nodes, spare_nodes, tasks_per_node -> one "job"
    called = _called()
    split = called.index("check_batch")
    own, on_mesh = [_section(c) for c in called[:split]], [_section(c) for c in called[split + 1:]]
    assert own == sorted(own, key=order.index) and on_mesh == sorted(on_mesh, key=order.index)
    assert len(set(own + on_mesh)) == len(own + on_mesh)  # one function per section
    for section in own + on_mesh:
        assert callable(getattr(checks, f"check_{section}", None) or getattr(checks, f"check_{section}_section"))
    # every section with keys a user can get wrong is checked
    assert {"job", "cluster", "model", "data", "task", "optim", "checkpoint", "scheme", "sync", "train", "dist",
            "fault", "run", "submit", "plan"} <= set(own + on_mesh)
