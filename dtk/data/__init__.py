"""data: datasets (synthetic, HDF5), the world-size-invariant global order, per-rank batches.
May import config and plan (pure: the validation split's check, one copy for the plan and the loader);
the login node imports hdf5's checks, so no torch at module level there."""
