#!/usr/bin/env bash
# N processes of one run on this machine, each with its own simulated CPU devices; their
# collectives go through gloo. The way to test multi-process behaviour (data loading per process,
# checkpoints written by every process, only process 0 printing) without a cluster.
#
#   bash examples/local_processes.sh 2 4 --config configs/tiny_3d.yaml --set train.steps=20
#   (2 processes x 4 devices = the (2, 2, 2) mesh of tiny_3d.yaml)
set -euo pipefail
n=${1:?number of processes}; devices=${2:?CPU devices per process}; shift 2
port=$((20000 + RANDOM % 20000))
pids=()
for ((i = 0; i < n; i++)); do
    python -m jaxpar.train "$@" --set runtime.cpu_devices="$devices" \
        --set runtime.coordinator=localhost:$port --set runtime.num_processes="$n" --set runtime.process_id=$i &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
