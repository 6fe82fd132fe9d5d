"""mesh: device, process group and the one named mesh (ParallelMesh) every later stage is handed.
May import config and plan (the axis table); no stage after it: the worker hands in its env
(dtk.mesh.init.WorkerRanks, which dtk.worker.env.WorkerEnv satisfies)."""
