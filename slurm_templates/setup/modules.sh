# Module loads for sites that use environment modules; add `modules` to cluster.setup.
# module load cuda/12.4 nccl/2.21
