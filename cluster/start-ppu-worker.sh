#!/usr/bin/env bash
# Join a PPU node (16 PPU per Zhenwu 810E node by default) to the cluster at HEAD_ADDRESS.
#   HEAD_ADDRESS=10.0.0.1:6379 bash cluster/start-ppu-worker.sh
set -euo pipefail
: "${HEAD_ADDRESS:?set HEAD_ADDRESS=host:port of the Ray head}"
export RAY_custom_unit_instance_resources="neuron_cores,TPU,NPU,HPU,RBLN,FURIOSA,TTNPU,MBLT,PPU"
export CUDA_DEVICE_MAX_CONNECTIONS=1
ray start --address="$HEAD_ADDRESS" --resources="{\"PPU\": ${PPU_COUNT:-16}}" "$@"
