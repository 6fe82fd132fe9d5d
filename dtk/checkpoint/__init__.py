"""checkpoint: sharded DCP save and load, the manifest committed last, verification, retention, export.
May import config, plan, dist (the mesh) and dtk.rundir; not train or worker."""
