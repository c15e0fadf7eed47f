# The Qwen2.5-7B pretraining launch on one 16-PPU node of Alibaba Cloud's PAI guide
# "在PAI上使用PPU开发训练模型" (step 2: the run_dsw_7b.sh it adds to Pai-Megatron-Patch's
# examples/qwen2_5), its 25 arguments unchanged, for trying entrypoints/from_pai_script.py:
#
#     python entrypoints/from_pai_script.py examples/run_dsw_7b.sh --output run.yaml
#     python entrypoints/pretrain.py --config run.yaml --dry-run --plan-only
#
# In order: ENV dsw (one node), MODEL_SIZE 7B, BATCH_SIZE 1, GLOBAL_BATCH_SIZE 256, LR 1e-5,
# MIN_LR 1e-6, SEQ_LEN 4096, PAD_LEN 4096, PR bf16, TP 1, PP 1, CP 1, SP true, DO true, FL true,
# SFT false, AC false, OPTIMIZER_OFFLOAD false, SAVE_INTERVAL 100000, DATASET_PATH,
# VALID_DATASET_PATH, PRETRAIN_CHECKPOINT_PATH, TRAIN_TOKENS 1e10, WARMUP_TOKENS 1e6,
# OUTPUT_BASEPATH. The commented-out exports are the guide's too (left as comments there).
unset NCCL_QUADRUPLE_CHANNELS
#export CUDA_VISIBLE_DEVICES=4,5,1,0,9,8,12,13,7,6,2,3,10,11,15,14
# export NCCL_SOCKET_IFNAME=eth0
#export MP_VP=2
sh run_mcore_qwen-no-overlap.sh \
dsw  \
7B   \
1    \
256 \
1e-5   \
1e-6   \
4096  \
4096  \
bf16  \
1  \
1 \
1 \
true \
true   \
true \
false \
false   \
false \
100000  \
/mnt/workspace/megatron-patch/qwen-datasets/wudao_qwenbpe_text_document  \
/mnt/workspace/megatron-patch/qwen-datasets/wudao_qwenbpe_text_document  \
/mnt/workspace/megatron-patch/qwen-ckpts/Qwen2.5-7B  \
10000000000  \
1000000   \
/mnt/workspace/megatron-patch/test_qwen2_5
