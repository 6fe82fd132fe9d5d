"""checkpoint: sharded DCP save and load, the manifest committed last, verification, retention, export.
May import config, plan, mesh (ParallelMesh), models (the hf export's config) and access (the command's
role check); not train or worker."""
