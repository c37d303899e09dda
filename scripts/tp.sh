#!/usr/bin/env bash
# Tensor-parallel launcher: N ranks of deltastate's TP layers under torchrun, NVLink multicast off.
#
#   scripts/tp.sh N [args of python -m deltastate.tp]    the harness (TP = N against TP = 1)
#   scripts/tp.sh bench N [args of bench/bench_tp.py]    the decode-step benchmark at TP = N
#
# The backend follows the device: gloo for --device cpu (or without a GPU), NCCL on CUDA
# (deltastate.tp.init_distributed). NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
# NVSHMEM_DISABLE_NVLS=1 are exported here and set again in every rank before its process group
# exists: NVLink multicast can take a shared host's GPUs out of service.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
if [ "${1:-}" = bench ]; then
  shift
  N=${1:?usage: scripts/tp.sh bench N [args]}; shift
  exec "$PY" -m torch.distributed.run --standalone --nproc-per-node="$N" bench/bench_tp.py "$@"
fi
N=${1:?usage: scripts/tp.sh N [args]}; shift
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node="$N" -m deltastate.tp "$@"
