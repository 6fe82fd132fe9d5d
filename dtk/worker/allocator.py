"""The CUDA caching allocator's settings a worker starts with (read once, when torch first
touches CUDA, so they are set before: dtk/worker/__main__.py)."""

from __future__ import annotations

from collections.abc import Mapping

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_ALIAS = "PYTORCH_ALLOC_CONF"  # torch's newer name for the same setting
EXPANDABLE = "expandable_segments:True"


def allocator_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add: expandable segments (one segment grows instead of many fixed
    ones fragmenting as micro-batch and checkpoint-staging shapes vary), unless the user set
    the allocator's configuration themselves, under either name."""
    if env.get(ALLOC_CONF) or env.get(ALLOC_CONF_ALIAS):
        return {}
    return {ALLOC_CONF: EXPANDABLE}
