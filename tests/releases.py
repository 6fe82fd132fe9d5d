"""dtk's releases and the commit each one is, for a clone that lacks the git tags (the
upgrade test builds the previous release from this record: tests/test_upgrade.py).

A release is tagged `git tag vX.Y.Z COMMIT` and gets a row here in the same change. What
stays readable across releases (run names, run directories, checkpoints) is in
docs/recovery.md, "Identity and upgrades".
"""

from __future__ import annotations

RELEASES: dict[str, str] = {
    "v0.1.0": "2e8c918d20670e931fe7d5244715c2422b5e5ac7",
}
"""Release tag -> commit, oldest first. v0.1.0 is main before run identity was declared per
field: it names runs by whole config sections (dtk/config/identity_v0.py) and reads
checkpoints' .metadata with plain pickle."""


def previous_release() -> tuple[str, str]:
    """(tag, commit) of the newest release: the one an upgrade comes from."""
    tag = list(RELEASES)[-1]
    return tag, RELEASES[tag]
