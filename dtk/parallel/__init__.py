"""parallelize: one apply_* per technique; parallelize.py is the only composition point.
May import config, plan, mesh and models; not train or checkpoint."""
