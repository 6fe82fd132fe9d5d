"""validate + plan: degrees, batch arithmetic and run identity from a Config; pure, no torch, no I/O.
May import dtk.config; the login node imports it, so nothing here may import torch."""
