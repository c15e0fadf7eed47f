#!/usr/bin/env bash
# Start the Ray head of a PPU cluster on a bare node (PAI-DSW / PAI-DLC / ECS style machines).
#
# Usage (settings are named environment variables, all optional; no positional arguments):
#   bash cluster/start-head.sh                          # CPU-only head, dashboard on loopback
#   PPU_COUNT=16 bash cluster/start-head.sh             # the head trains as well
#   DASHBOARD_HOST=10.0.0.1 bash cluster/start-head.sh  # dashboard / job API on a cluster NIC
#
#   PPU_COUNT            PPUs this node advertises as Ray resource "PPU" (default 0: no
#                        training worker is placed on the head)
#   RAY_PORT             GCS port the workers join (default 6379)
#   DASHBOARD_HOST       address the dashboard and the job-submission API listen on
#                        (default 127.0.0.1: reachable from this machine only, e.g. via ssh -L)
#   DASHBOARD_PORT       (default 8265)
#   NODE_IP_ADDRESS      this node's cluster address (passed to ray start when set; else guessed
#                        for the hints printed at the end)
#   RAY_AUTH_MODE        token (default). "disabled" switches Ray's authentication off: anyone
#                        who reaches the ports can then run code here. Not recommended.
#   RAY_AUTH_TOKEN_PATH  a file holding the cluster token; default ~/.ray/auth_token, created
#                        (mode 600) by `ray get-auth-token --generate` if missing
#   RAY_AUTH_TOKEN       the token itself (instead of a file; never printed)
#   NCCL_SOCKET_IFNAME   passed on to the training workers when set
#   RAY_START_ARGS       extra `ray start` flags, split on whitespace (e.g. "--num-cpus=64")
#
# The token value is never printed; the script names where it is kept.
set -euo pipefail

PPU_COUNT="${PPU_COUNT:-0}"
RAY_PORT="${RAY_PORT:-6379}"
DASHBOARD_HOST="${DASHBOARD_HOST:-127.0.0.1}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"
NODE_IP_ADDRESS="${NODE_IP_ADDRESS:-}"
RAY_START_ARGS="${RAY_START_ARGS:-}"

case "$PPU_COUNT" in
  '' | *[!0-9]*) echo "PPU_COUNT must be a whole number, got '$PPU_COUNT'" >&2; exit 2 ;;
esac

# --- environment every Ray worker process on this node inherits ---------------------------
# Ray's default unit-instance accelerators plus PPU: each worker holding {"PPU": n} gets its
# own PPU ids (ray_ppu binds them with torch.cuda.set_device).
export RAY_custom_unit_instance_resources="neuron_cores,TPU,NPU,HPU,RBLN,FURIOSA,TTNPU,MBLT,PPU"
# As the reference PAI-Megatron-Patch script: one hardware queue, so tensor-parallel
# communication and compute kernels are issued in order.
export CUDA_DEVICE_MAX_CONNECTIONS=1
# `ray job stop` SIGTERMs the job, then kills it after this many seconds (Ray's default: 3).
# ray_ppu's workers save a checkpoint on that signal within checkpoint.stop_timeout_s (300 s
# by default): the wait covers it, with 30 s to spare.
export RAY_JOB_STOP_WAIT_TIME_S="${RAY_JOB_STOP_WAIT_TIME_S:-330}"
# The reference run_dsw_7b.sh unsets this NCCL tuning variable before training.
unset NCCL_QUADRUPLE_CHANNELS
if [[ -n "${NCCL_SOCKET_IFNAME:-}" ]]; then export NCCL_SOCKET_IFNAME; fi

# --- token authentication (Ray >= 2.52: RAY_AUTH_MODE, RAY_AUTH_TOKEN[_PATH]) ---------------
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
case "$RAY_AUTH_MODE" in
  token | disabled) ;;
  *) echo "RAY_AUTH_MODE must be token or disabled, got '$RAY_AUTH_MODE'" >&2; exit 2 ;;
esac
token_hint=""
if [[ "$RAY_AUTH_MODE" == "token" ]]; then
  if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
    token_hint="the RAY_AUTH_TOKEN environment variable of this shell"
  elif [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
    if [[ ! -s "$RAY_AUTH_TOKEN_PATH" ]]; then
      echo "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is missing or empty" >&2
      exit 1
    fi
    token_hint="$RAY_AUTH_TOKEN_PATH"
  else
    token_file="$HOME/.ray/auth_token"
    if [[ ! -s "$token_file" ]]; then
      # `ray get-auth-token` writes the token to stdout: keep it off the terminal and logs.
      (umask 077 && ray get-auth-token --generate >/dev/null)
      chmod 600 "$token_file"
      echo "Generated a new cluster token in $token_file (mode 600)."
    elif [[ -n "$(find "$token_file" -perm /077 2>/dev/null)" ]]; then
      echo "warning: $token_file is readable by other users; run: chmod 600 $token_file" >&2
    fi
    token_hint="$token_file"
  fi
else
  echo "warning: RAY_AUTH_MODE=$RAY_AUTH_MODE: token authentication is OFF; anyone who can" \
       "reach this node's Ray ports can run code on the cluster." >&2
fi

# --- start -----------------------------------------------------------------------------------
start_args=(--head --port="$RAY_PORT"
            --dashboard-host="$DASHBOARD_HOST" --dashboard-port="$DASHBOARD_PORT"
            --resources="{\"PPU\": $PPU_COUNT}")
if [[ -n "$NODE_IP_ADDRESS" ]]; then start_args+=(--node-ip-address="$NODE_IP_ADDRESS"); fi
read -r -a extra_args <<< "$RAY_START_ARGS"
ray start "${start_args[@]}" ${extra_args[@]+"${extra_args[@]}"}

# --- how to use it ---------------------------------------------------------------------------
head_ip="${NODE_IP_ADDRESS:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
head_ip="${head_ip:-$(hostname)}"
case "$DASHBOARD_HOST" in
  127.* | localhost | ::1) loopback=1; dash_url="http://127.0.0.1:$DASHBOARD_PORT" ;;
  0.0.0.0 | ::) loopback=0; dash_url="http://$head_ip:$DASHBOARD_PORT" ;;
  *) loopback=0; dash_url="http://$DASHBOARD_HOST:$DASHBOARD_PORT" ;;
esac

echo
echo "Ray head is up: GCS $head_ip:$RAY_PORT, $PPU_COUNT PPU on this node."
if [[ "$loopback" == 1 ]]; then
  echo "Dashboard and job API: $dash_url (loopback only)."
else
  echo "Dashboard and job API: $dash_url (listening on $DASHBOARD_HOST: reachable from that network)."
fi
if [[ "$RAY_AUTH_MODE" == "token" ]]; then
  echo "Token authentication is on. The token is in $token_hint (its value is not shown)."
  echo
  echo "Join each PPU node: give it the same token (e.g. scp -p the file to ~/.ray/auth_token"
  echo "there, mode 600, or set RAY_AUTH_TOKEN_PATH), then on that node:"
  echo "  HEAD_ADDRESS=$head_ip:$RAY_PORT bash cluster/start-ppu-worker.sh"
  echo
  echo "Submit a job (the client must also run in token mode and find the token):"
  if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
    echo "  export RAY_AUTH_MODE=token        # RAY_AUTH_TOKEN as set in this shell"
  else
    echo "  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$token_hint"
  fi
else
  echo
  echo "Join each PPU node:  HEAD_ADDRESS=$head_ip:$RAY_PORT RAY_AUTH_MODE=$RAY_AUTH_MODE bash cluster/start-ppu-worker.sh"
  echo
  echo "Submit a job:"
fi
echo "  ray job submit --address $dash_url --working-dir . --runtime-env cluster/runtime_env.yaml \\"
echo "      -- python entrypoints/pretrain.py --config run.yaml"
if [[ "$loopback" == 1 ]]; then
  echo "From another machine, copy the token file there, open a tunnel to the loopback-only"
  echo "dashboard and submit to the local end of the tunnel as above:"
  echo "  ssh -N -L $DASHBOARD_PORT:127.0.0.1:$DASHBOARD_PORT USER@$head_ip"
fi
