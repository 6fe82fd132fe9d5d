# NCCL environment for multi-node GPU jobs. Sourced by the batch script before the driver.
# Fail loudly instead of silently falling back to TCP sockets when InfiniBand is expected.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_ASYNC_ERROR_HANDLING=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# export NCCL_IB_HCA=mlx5      # the site's InfiniBand adapters
# export NCCL_SOCKET_IFNAME=ib0
