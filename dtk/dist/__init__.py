"""dist: device, process group and the one named mesh (ParallelMesh) every later stage is handed.
May import config, plan (the axis table) and worker.env; no stage after it."""
