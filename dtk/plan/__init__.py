"""validate + plan: degrees, batch arithmetic and run identity from a Config; pure, no torch, no I/O.
May import config only; the login node imports it, so nothing here may import torch (a user's model
is counted by dtk.parallel.count, in a subprocess)."""
