#!/usr/bin/env bash
# Join a PPU node (a Zhenwu 810E machine: 16 PPUs) to the Ray cluster whose head runs
# cluster/start-head.sh.
#
# Usage (settings are named environment variables; no positional arguments):
#   HEAD_ADDRESS=10.0.0.1:6379 bash cluster/start-ppu-worker.sh
#   HEAD_ADDRESS=10.0.0.1:6379 PPU_COUNT=8 bash cluster/start-ppu-worker.sh
#
#   HEAD_ADDRESS         host:port of the head's GCS (required)
#   PPU_COUNT            PPUs this node advertises as Ray resource "PPU"; default: what
#                        `python -c 'import torch; print(torch.cuda.device_count())'` reports,
#                        or 16 (one Zhenwu 810E node) when that finds none
#   PYTHON               interpreter used for that detection (default: python)
#   NODE_IP_ADDRESS      this node's cluster address (passed to ray start when set)
#   RAY_AUTH_MODE        token (default; must match the head). "disabled" only for a head
#                        started with RAY_AUTH_MODE=disabled.
#   RAY_AUTH_TOKEN_PATH  file holding the head's token (default ~/.ray/auth_token: copy the
#                        head's file there, mode 600)
#   RAY_AUTH_TOKEN       the token itself (instead of a file; never printed)
#   NCCL_SOCKET_IFNAME   passed on to the training workers when set
#   RAY_START_ARGS       extra `ray start` flags, split on whitespace (e.g. "--num-cpus=128")
set -euo pipefail

: "${HEAD_ADDRESS:?set HEAD_ADDRESS=host:port of the Ray head (see cluster/start-head.sh)}"
PYTHON="${PYTHON:-python}"
NODE_IP_ADDRESS="${NODE_IP_ADDRESS:-}"
RAY_START_ARGS="${RAY_START_ARGS:-}"
DEFAULT_PPU_COUNT=16

if [[ -z "${PPU_COUNT:-}" ]]; then
  detected=""
  if command -v "$PYTHON" >/dev/null 2>&1; then
    detected="$(timeout 120 "$PYTHON" -c 'import torch; print(torch.cuda.device_count())' \
                2>/dev/null | tail -n 1 || true)"
  fi
  if [[ "$detected" =~ ^[0-9]+$ && "$detected" -gt 0 ]]; then
    PPU_COUNT="$detected"
    echo "Detected $PPU_COUNT PPU on this node (torch.cuda.device_count())."
  else
    PPU_COUNT="$DEFAULT_PPU_COUNT"
    echo "warning: no PPU detected with $PYTHON (torch.cuda.device_count()); advertising" \
         "$PPU_COUNT. Set PPU_COUNT to override." >&2
  fi
fi
case "$PPU_COUNT" in
  '' | *[!0-9]*) echo "PPU_COUNT must be a whole number, got '$PPU_COUNT'" >&2; exit 2 ;;
esac

# --- environment every Ray worker process on this node inherits (same as the head) --------
export RAY_custom_unit_instance_resources="neuron_cores,TPU,NPU,HPU,RBLN,FURIOSA,TTNPU,MBLT,PPU"
export CUDA_DEVICE_MAX_CONNECTIONS=1
unset NCCL_QUADRUPLE_CHANNELS
if [[ -n "${NCCL_SOCKET_IFNAME:-}" ]]; then export NCCL_SOCKET_IFNAME; fi

# --- token authentication: this node needs the head's token ---------------------------------
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
case "$RAY_AUTH_MODE" in
  token)
    if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
      :
    elif [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
      if [[ ! -s "$RAY_AUTH_TOKEN_PATH" ]]; then
        echo "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is missing or empty" >&2
        exit 1
      fi
    elif [[ ! -s "$HOME/.ray/auth_token" ]]; then
      echo "No cluster token on this node. Copy the head's token file to ~/.ray/auth_token" \
           "(mode 600) or set RAY_AUTH_TOKEN_PATH to it, then run this again." >&2
      exit 1
    fi
    ;;
  disabled)
    echo "warning: RAY_AUTH_MODE=disabled: token authentication is OFF." >&2 ;;
  *) echo "RAY_AUTH_MODE must be token or disabled, got '$RAY_AUTH_MODE'" >&2; exit 2 ;;
esac

# --- start -----------------------------------------------------------------------------------
start_args=(--address="$HEAD_ADDRESS" --resources="{\"PPU\": $PPU_COUNT}")
if [[ -n "$NODE_IP_ADDRESS" ]]; then start_args+=(--node-ip-address="$NODE_IP_ADDRESS"); fi
read -r -a extra_args <<< "$RAY_START_ARGS"
ray start "${start_args[@]}" ${extra_args[@]+"${extra_args[@]}"}

echo
echo "Joined $HEAD_ADDRESS with $PPU_COUNT PPU. Check with: RAY_AUTH_MODE=$RAY_AUTH_MODE ray status"
