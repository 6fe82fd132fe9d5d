"""data: datasets (synthetic, HDF5), the world-size-invariant global order, per-rank batches.
May import config only (and dtk.errors); the login node imports hdf5's checks, so no torch at module level there."""
