"""Field metadata of the schemas: which keys are a run's identity (what it computes).

A leaf module (no dtk imports), so the schemas can mark their fields and the hash
(dtk/config/identity.py) can read the marks without an import cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

IDENTITY: dict[str, Any] = {"identity": True}
"""Field metadata of an identity key: `lr: float = field(default=3e-3, metadata=IDENTITY)`."""


def is_identity(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("identity"))


def field_default(f: dataclasses.Field) -> Any:
    """The schema default of one field (dataclasses.MISSING where it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING
