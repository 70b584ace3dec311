#!/usr/bin/env bash
# A two-"node" MatrixFSDP job on one machine: 2 torchrun agents (node ranks 0 and 1),
# 2 processes each, HSDP with shard_size=2 (one shard group per "node", 2 replicas).
# Runs offline on CPU (gloo) in well under a minute; on a GPU machine it uses the GPUs.
#
#   bash examples/multi_node.sh                        # defaults below
#   bash examples/multi_node.sh --max-steps 50         # extra flags go to multi_node.py
#   NPROC_PER_NODE=4 SHARD_SIZE=4 bash examples/multi_node.sh
#
# On a real cluster, run the same torchrun line once per node with the head node's
# address instead of 127.0.0.1 (see docs/multi-node.md).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NNODES="${NNODES:-2}"
NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
SHARD_SIZE="${SHARD_SIZE:-$NPROC_PER_NODE}"
MAX_STEPS="${MAX_STEPS:-5}"
TORCHRUN="${TORCHRUN:-torchrun}"
MASTER_PORT="${MASTER_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"

pids=()
for ((node = 0; node < NNODES; node++)); do
    # One torchrun agent per "node"; on a cluster each would run on its own host.
    $TORCHRUN --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --node-rank "$node" \
        --master-addr 127.0.0.1 --master-port "$MASTER_PORT" \
        "$HERE/multi_node.py" --num-nodes "$NNODES" --devices "$NPROC_PER_NODE" --shard-size "$SHARD_SIZE" \
        --accelerator "${ACCELERATOR:-auto}" --max-steps "$MAX_STEPS" --d-model 64 --n-layers 2 --seq-len 64 \
        "$@" &
    pids+=("$!")
done

status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
exit "$status"
