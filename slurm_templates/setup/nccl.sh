# NCCL environment for multi-node GPU jobs. Sourced by the batch script before the driver.
# Warnings only on the console. Each worker still has NCCL write an INFO report of its
# INIT and NET subsystems, warnings included, to logs/start_NN/nccl/NODE.rankR.log, which
# dtk reads to check the transport (fabric.require) and whose warnings it repeats in the
# rank's log; NCCL_DEBUG=INFO or an NCCL_DEBUG_FILE of your own turns that check off.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_ASYNC_ERROR_HANDLING=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# export NCCL_IB_HCA=mlx5      # the site's InfiniBand adapters
# export NCCL_SOCKET_IFNAME=ib0
