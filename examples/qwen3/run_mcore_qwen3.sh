#!/bin/bash
# A stand-in for Pai-Megatron-Patch's examples/qwen3/run_mcore_qwen3.sh, written for ray_ppu:
# the same 27 positional arguments (ETP and EP after CP) and a MODEL_SIZE branch per Qwen3 size
# whose model options are those the published script passes at a098ca5 (the sizes listed in
# ray_ppu/tools/pai_migration/qwen3.py). It lets the migration read a script's MODEL_SIZE
# branches without a Pai-Megatron-Patch checkout; edit a branch to see how a change maps:
#
#     python entrypoints/from_pai_script.py --script examples/qwen3/run_mcore_qwen3.sh \
#         --output a3b.yaml -- dsw A3B 1 32 1e-5 1e-6 1024 1024 bf16 2 1 1 1 8 true true true \
#         false sel false 100000 DATASET_PATH VALID_DATASET_PATH none 1000000000 10000000 OUT
#
# Run by bash, it only prints the Megatron options it would pass (it trains nothing).
ENV=$1
MODEL_SIZE=$2
TP=${10}
PP=${11}
CP=${12}
ETP=${13}
EP=${14}
if [ $MODEL_SIZE = 0.6B ]; then
    NUM_LAYERS=28
    HIDDEN_SIZE=1024
    NUM_ATTENTION_HEADS=16
    INTERMEDIATE_SIZE=3072
    NUM_KEY_VALUE_HEADS=8
    MAX_POSITION_EMBEDDINGS=40960
    VOCAB_SIZE=151936
    ROPE_THETA=1000000
    RMS_NORM_EPS=1e-6
    moe_options=""
    tie_option=""
    gqa_options=" \
        --group-query-attention \
        --num-query-groups ${NUM_KEY_VALUE_HEADS}"
elif [ $MODEL_SIZE = 1.7B ]; then
    NUM_LAYERS=28
    HIDDEN_SIZE=2048
    NUM_ATTENTION_HEADS=16
    INTERMEDIATE_SIZE=6144
    NUM_KEY_VALUE_HEADS=8
    MAX_POSITION_EMBEDDINGS=40960
    VOCAB_SIZE=151936
    ROPE_THETA=1000000
    RMS_NORM_EPS=1e-6
    moe_options=""
    tie_option=""
    gqa_options=" \
        --group-query-attention \
        --num-query-groups ${NUM_KEY_VALUE_HEADS}"
elif [ $MODEL_SIZE = 4B ]; then
    NUM_LAYERS=36
    HIDDEN_SIZE=2560
    NUM_ATTENTION_HEADS=32
    INTERMEDIATE_SIZE=9728
    NUM_KEY_VALUE_HEADS=8
    MAX_POSITION_EMBEDDINGS=40960
    VOCAB_SIZE=151936
    ROPE_THETA=1000000
    RMS_NORM_EPS=1e-6
    moe_options=""
    tie_option=""
    gqa_options=" \
        --group-query-attention \
        --num-query-groups ${NUM_KEY_VALUE_HEADS}"
elif [ $MODEL_SIZE = 8B ]; then
    NUM_LAYERS=36
    HIDDEN_SIZE=4096
    NUM_ATTENTION_HEADS=32
    INTERMEDIATE_SIZE=12288
    NUM_KEY_VALUE_HEADS=8
    MAX_POSITION_EMBEDDINGS=40960
    VOCAB_SIZE=151936
    ROPE_THETA=1000000
    RMS_NORM_EPS=1e-6
    moe_options=""
    tie_option="--untie-embeddings-and-output-weights"
    gqa_options=" \
        --group-query-attention \
        --num-query-groups ${NUM_KEY_VALUE_HEADS}"
elif [ $MODEL_SIZE = 14B ]; then
    NUM_LAYERS=40
    HIDDEN_SIZE=5120
    NUM_ATTENTION_HEADS=40
    INTERMEDIATE_SIZE=17408
    NUM_KEY_VALUE_HEADS=8
    MAX_POSITION_EMBEDDINGS=40960
    VOCAB_SIZE=151936
    ROPE_THETA=1000000
    RMS_NORM_EPS=1e-6
    moe_options=""
    tie_option="--untie-embeddings-and-output-weights"
    gqa_options=" \
        --group-query-attention \
        --num-query-groups ${NUM_KEY_VALUE_HEADS}"
elif [ $MODEL_SIZE = 32B ]; then
    NUM_LAYERS=64
    HIDDEN_SIZE=5120
    NUM_ATTENTION_HEADS=64
    INTERMEDIATE_SIZE=25600
    NUM_KEY_VALUE_HEADS=8
    MAX_POSITION_EMBEDDINGS=40960
    VOCAB_SIZE=151936
    ROPE_THETA=1000000
    RMS_NORM_EPS=1e-6
    moe_options=""
    tie_option="--untie-embeddings-and-output-weights"
    gqa_options=" \
        --group-query-attention \
        --num-query-groups ${NUM_KEY_VALUE_HEADS}"
elif [ $MODEL_SIZE = A3B ]; then
    NUM_LAYERS=48
    HIDDEN_SIZE=2048
    NUM_ATTENTION_HEADS=32
    INTERMEDIATE_SIZE=6144
    NUM_KEY_VALUE_HEADS=4
    MAX_POSITION_EMBEDDINGS=40960
    VOCAB_SIZE=151936
    ROPE_THETA=1000000
    RMS_NORM_EPS=1e-6
    NUM_EXPERTS=128
    ROUTER_TOPK=8
    MOE_INTERMEDIATE_SIZE=768
    moe_options=" \
        --moe-grouped-gemm \
        --moe-token-dispatcher-type alltoall \
        --moe-router-topk ${ROUTER_TOPK} \
        --num-experts ${NUM_EXPERTS} \
        --expert-tensor-parallel-size ${ETP} \
        --expert-model-parallel-size ${EP} \
        --moe-ffn-hidden-size ${MOE_INTERMEDIATE_SIZE} \
        --moe-router-load-balancing-type aux_loss \
        --moe-aux-loss-coeff 0.001 \
        --moe-layer-freq '([1]*48)'"
    tie_option="--untie-embeddings-and-output-weights"
    gqa_options=" \
        --group-query-attention \
        --num-query-groups ${NUM_KEY_VALUE_HEADS}"
elif [ $MODEL_SIZE = A22B ]; then
    NUM_LAYERS=94
    HIDDEN_SIZE=4096
    NUM_ATTENTION_HEADS=64
    INTERMEDIATE_SIZE=12288
    NUM_KEY_VALUE_HEADS=4
    MAX_POSITION_EMBEDDINGS=40960
    VOCAB_SIZE=151936
    ROPE_THETA=1000000
    RMS_NORM_EPS=1e-6
    NUM_EXPERTS=128
    ROUTER_TOPK=8
    MOE_INTERMEDIATE_SIZE=1536
    moe_options=" \
        --moe-grouped-gemm \
        --moe-token-dispatcher-type alltoall \
        --moe-router-topk ${ROUTER_TOPK} \
        --num-experts ${NUM_EXPERTS} \
        --expert-tensor-parallel-size ${ETP} \
        --expert-model-parallel-size ${EP} \
        --moe-ffn-hidden-size ${MOE_INTERMEDIATE_SIZE} \
        --moe-router-load-balancing-type aux_loss \
        --moe-aux-loss-coeff 0.001 \
        --moe-layer-freq '([1]*94)'"
    tie_option="--untie-embeddings-and-output-weights"
    gqa_options=" \
        --group-query-attention \
        --num-query-groups ${NUM_KEY_VALUE_HEADS}"
else
    echo "MODEL_SIZE=$MODEL_SIZE: expected 0.6B, 1.7B, 4B, 8B, 14B, 32B, A3B or A22B" >&2
    exit 2
fi

echo --num-layers ${NUM_LAYERS} --hidden-size ${HIDDEN_SIZE} \
    --num-attention-heads ${NUM_ATTENTION_HEADS} --ffn-hidden-size ${INTERMEDIATE_SIZE} \
    --max-position-embeddings ${MAX_POSITION_EMBEDDINGS} --padded-vocab-size ${VOCAB_SIZE} \
    --norm-epsilon ${RMS_NORM_EPS} --rotary-base ${ROPE_THETA} --qk-layernorm --kv-channels 128 \
    --tensor-model-parallel-size ${TP} --pipeline-model-parallel-size ${PP} \
    --context-parallel-size ${CP} ${moe_options} ${tie_option} ${gqa_options}
