"""Names of the step phases, shared by the workers that measure them and the report that
reads them (which must not import torch)."""

PHASES = ("data", "forward", "backward", "optimizer", "comm", "checkpoint", "straggler")
"""The phases of metrics.jsonl, in step order."""
IDLE_PHASES = ("data", "comm", "checkpoint", "straggler")
"""Phases in which the accelerator waits: idle_share = their sum / step time."""
