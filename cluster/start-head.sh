#!/usr/bin/env bash
# Start the Ray head node. It advertises no PPU by default (schedule no training on it);
# pass PPU_COUNT=16 to make the head a training node as well.
#   PPU_COUNT=16 bash cluster/start-head.sh
set -euo pipefail
# Ray's default unit-instance accelerators plus PPU: workers get distinct PPU ids.
export RAY_custom_unit_instance_resources="neuron_cores,TPU,NPU,HPU,RBLN,FURIOSA,TTNPU,MBLT,PPU"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # as the reference script: ordered TP comm/compute
ray start --head --resources="{\"PPU\": ${PPU_COUNT:-0}}" "$@"
echo "submit with: ray job submit --working-dir . -- python entrypoints/pretrain.py --config run.yaml"
