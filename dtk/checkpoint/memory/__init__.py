"""The in-memory tier of state (DESIGN.md "Tiers of state"): every rank's snapshot in host
memory (store.py), its replica on a peer, the store's root and its sweep (root.py), loading
from memory or a peer with a reshard on a shrink (load.py) and the tier as the checkpoint
manager uses it (tier.py). Runs on every rank; part of dtk.checkpoint and under its rule.
"""
