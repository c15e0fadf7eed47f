"""ray_ppu.tools.pai_migration (entrypoints/from_pai_script.py): the PAI guide's 7B launch
(``run_dsw_7b.sh``) migrated and dry-run through pretrain.py, and one in-process test per quirk
of run_mcore_qwen-no-overlap.sh that the migration reproduces (config values plus the
reinterpretation line the entry point prints on stderr); then run_mcore_qwen3.sh: a Qwen3-MoE
launch mapped and dry-run, the dense sizes, and a user's copy of the script whose MoE options
ray_ppu reproduces, reports as not reproduced, or refuses."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO

from ray_ppu.config.loader import load
from ray_ppu.errors import MigrationError
from ray_ppu.plan import build_plan
from ray_ppu.tools import pai_migration

DATA = "/mnt/workspace/megatron-patch/qwen-datasets/wudao_qwenbpe_text_document"
CKPT = "/mnt/workspace/megatron-patch/qwen-ckpts/Qwen2.5-7B"
OUT = "/mnt/workspace/megatron-patch/test_qwen2_5"
# run_dsw_7b.sh of the PAI guide (reference/pai-ppu-training-zh.txt), argument by argument.
REFERENCE = dict(
    ENV="dsw", MODEL_SIZE="7B", BATCH_SIZE="1", GLOBAL_BATCH_SIZE="256", LR="1e-5", MIN_LR="1e-6",
    SEQ_LEN="4096", PAD_LEN="4096", PR="bf16", TP="1", PP="1", CP="1", SP="true", DO="true",
    FL="true", SFT="false", AC="false", OPTIMIZER_OFFLOAD="false", SAVE_INTERVAL="100000",
    DATASET_PATH=DATA, VALID_DATASET_PATH=DATA, PRETRAIN_CHECKPOINT_PATH=CKPT,
    TRAIN_TOKENS_OR_ITERS="10000000000", WARMUP_TOKENS_OR_ITERS="1000000", OUTPUT_BASEPATH=OUT,
)
SP_LINE = ("SP=true with TP=1: the script drops sequence parallelism; "
           "parallel.sequence_parallel=false")


def arguments(**changes) -> list[str]:
    values = {**REFERENCE, **changes}
    return [values[name] for name in pai_migration.ARGUMENTS]


def migrate(tmp_path, env=None, **changes):
    """Run the migration in-process: (exit status, YAML tree or None, stderr lines) as the entry
    point gives them: 0 and the notes, or 2 and the MigrationError's lines."""
    out = tmp_path / "run.yaml"
    out.unlink(missing_ok=True)
    try:
        migrated = pai_migration.migrate_launch(arguments(**changes), env or {}, output=out)
    except MigrationError as err:
        return 2, None, str(err).splitlines()
    return 0, yaml.safe_load(out.read_text()), migrated.notes


def cli(*argv, **env) -> subprocess.CompletedProcess:
    """entrypoints/from_pai_script.py as a user runs it; of the script's environment variables
    (MP_*, WORLD_SIZE) it sees only ``env``."""
    environ = {k: v for k, v in os.environ.items() if k not in pai_migration.ENV_VARS}
    return subprocess.run([sys.executable, str(REPO / "entrypoints" / "from_pai_script.py"),
                           *argv], capture_output=True, text=True, env={**environ, **env},
                          timeout=120)


def plan_of(tmp_path):
    return build_plan(load(tmp_path / "run.yaml"))


def dry_run(config_path) -> dict:
    result = subprocess.run([sys.executable, str(REPO / "entrypoints" / "pretrain.py"),
                             "--config", str(config_path), "--dry-run", "--plan-only"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def assert_reference_7b(dry: dict) -> None:
    cfg, plan, tc = dry["config"], dry["plan"], dry["megatron"]["TransformerConfig"]
    assert cfg["model"]["preset"] == "7B"
    p = cfg["parallel"]
    assert (p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"],
            p["context_parallel_size"]) == (1, 1, 1)
    assert p["sequence_parallel"] is False and tc["sequence_parallel"] is False
    assert cfg["training"]["use_distributed_optimizer"] is True
    assert cfg["training"]["attention_backend"] == "flash" and tc["attention_backend"] == "flash"
    assert cfg["memory"]["recompute"] == "none" and tc["recompute_granularity"] is None
    assert cfg["training"]["precision"] == "bf16" and tc["bf16"] is True
    assert cfg["cluster"]["num_workers"] == 16
    # 10000000000 / 256 / 4096 = 9536 (9536.7), 1000000 / 256 / 4096 = 0 (0.95)
    assert (plan["train_iters"], plan["lr_warmup_iters"], plan["lr_decay_iters"]) == (9536, 0, 9536)
    # run_mcore_qwen-no-overlap.sh never passes its overlap options
    ddp = dry["megatron"]["DistributedDataParallelConfig"]
    assert ddp["overlap_grad_reduce"] is False and ddp["overlap_param_gather"] is False
    assert cfg["training"]["eval_interval"] == 10000 and cfg["training"]["eval_iters"] == 10
    assert cfg["checkpoint"]["save_interval"] == 100000
    assert cfg["checkpoint"]["load"] == CKPT and cfg["checkpoint"]["finetune"] is True
    name = ("pretrain-mcore-qwen2.5-7B-lr-1e-5-minlr-1e-6-bs-1-gbs-256-seqlen-4096-pr-bf16-"
            "tp-1-pp-1-cp-1-ac-false-do-true-sp-true-ti-9536-wi-0")
    assert cfg["output"]["name"] == name and cfg["output"]["dir"] == f"{OUT}/{name}"


def test_reference_7b_arguments_dry_run(tmp_path):
    status, tree, err = migrate(tmp_path)
    assert status == 0, err
    assert SP_LINE in err
    assert any(line.startswith("AC=false is none of sel, full, offload, none") for line in err)
    assert any("not on this machine" in line and "set checkpoint.pretrained=" in line
               for line in err)
    text = (tmp_path / "run.yaml").read_text()
    assert "TRAIN_TOKENS 10000000000 / GLOBAL_BATCH_SIZE 256 / SEQ_LEN 4096 = 9536" in text
    assert_reference_7b(dry_run(tmp_path / "run.yaml"))


RUN_DSW_7B = f"""unset NCCL_QUADRUPLE_CHANNELS
#export CUDA_VISIBLE_DEVICES=4,5,1,0,9,8,12,13,7,6,2,3,10,11,15,14
# export NCCL_SOCKET_IFNAME=eth0
#export MP_VP=2
export MP_AC_LAYERS=1
DATA={DATA}
cd /mnt/workspace/megatron-patch/Pai-Megatron-Patch/examples/qwen2_5 && \\
MP_DATASET_TYPE=idxmap sh run_mcore_qwen-no-overlap.sh \\
dsw  \\
7B   \\
1    \\
256 \\
1e-5   \\
1e-6   \\
4096  \\
4096  \\
bf16  \\
1  \\
1 \\
1 \\
true \\
true   \\
true \\
false \\
false   \\
false \\
100000  \\
$DATA  \\
${{DATA}}  \\
{CKPT}  \\
10000000000  \\
1000000   \\
{OUT}
"""


def test_reference_7b_script_file_dry_run(tmp_path):
    script = tmp_path / "run_dsw_7b.sh"
    script.write_text(RUN_DSW_7B)
    out = tmp_path / "from_script.yaml"
    proc = cli(str(script), "--output", str(out), MP_VP="")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.splitlines()
    assert SP_LINE in err
    # the same config as from the arguments (the commented-out MP_VP=2 stayed a comment)
    assert cli("--output", str(tmp_path / "run.yaml"), "--", *arguments()).returncode == 0
    assert yaml.safe_load(out.read_text()) == yaml.safe_load((tmp_path / "run.yaml").read_text())
    assert "MP_DATASET_TYPE=idxmap MP_AC_LAYERS=1" in out.read_text()  # the environment it saw
    assert_reference_7b(dry_run(out))


def test_script_file_without_a_call_is_an_error(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("#sh run_mcore_qwen.sh dsw 7B\necho nothing\n")
    proc = cli(str(script))
    assert proc.returncode == 2
    assert "found 0" in proc.stderr


def test_pretraining_iterations_use_bash_integer_division(tmp_path):
    tokens = 3 * 2**60 - 1  # tokens / 48 / 64 is 2**50 - 1/3072: a double rounds it up to 2**50
    status, tree, err = migrate(tmp_path, GLOBAL_BATCH_SIZE="48", SEQ_LEN="64",
                                PAD_LEN="64", TRAIN_TOKENS_OR_ITERS=str(tokens),
                                WARMUP_TOKENS_OR_ITERS="1000000")
    assert status == 0, err
    t = tree["training"]
    assert int(tokens / 48 / 64) == 2**50  # what float division would give
    assert t["train_iters"] == 2**50 - 1 == t["lr_decay_iters"]
    assert t["lr_warmup_iters"] == 325  # 1000000 / 48 / 64 = 325.5
    assert "train_tokens" not in t and "lr_warmup_tokens" not in t
    plan = plan_of(tmp_path)
    assert (plan.train_iters, plan.lr_warmup_iters) == (2**50 - 1, 325)
    assert not any("TRAIN_TOKENS_OR_ITERS" in line for line in err)  # plain integers: no note


def test_scientific_notation_is_the_number_it_denotes_with_a_note(tmp_path):
    status, tree, err = migrate(tmp_path, TRAIN_TOKENS_OR_ITERS="1e10")
    assert status == 0, err
    assert tree["training"]["train_iters"] == 9536
    assert ("TRAIN_TOKENS_OR_ITERS=1e10: bash $(( )) cannot parse 1e10 (the script would stop "
            "with an arithmetic syntax error); taken as 10000000000") in err
    status, _, err = migrate(tmp_path, TRAIN_TOKENS_OR_ITERS="1.5e-3")
    assert status == 2 and "TRAIN_TOKENS_OR_ITERS (${23})" in err[0]


def test_sequence_parallel_only_with_tp_above_one(tmp_path):
    status, tree, err = migrate(tmp_path, SP="true", TP="1")
    assert status == 0 and tree["parallel"]["sequence_parallel"] is False
    assert SP_LINE in err
    status, tree, err = migrate(tmp_path, SP="true", TP="2")
    assert status == 0 and tree["parallel"]["sequence_parallel"] is True
    assert tree["parallel"]["tensor_model_parallel_size"] == 2
    assert not any(line.startswith("SP=") for line in err)


@pytest.mark.parametrize("ac", ["false", "off"])
def test_unknown_ac_value_means_no_recompute(tmp_path, ac):
    status, tree, err = migrate(tmp_path, AC=ac)
    assert status == 0 and tree["memory"]["recompute"] == "none"
    assert (f"AC={ac} is none of sel, full, offload, none: the script adds no recompute option; "
            f"memory.recompute=none") in err
    status, tree, err = migrate(tmp_path, AC="sel")
    assert tree["memory"]["recompute"] == "selective" and not any(l.startswith("AC=") for l in err)


def test_optimizer_offload_forces_the_distributed_optimizer(tmp_path):
    status, tree, err = migrate(tmp_path, DO="false", OPTIMIZER_OFFLOAD="static")
    assert status == 0, err
    assert tree["training"]["use_distributed_optimizer"] is True
    assert tree["memory"]["optimizer_offload"] == "static"
    assert tree["memory"]["optimizer_offload_fraction"] == 1.0
    assert ("OPTIMIZER_OFFLOAD=static with DO=false: the script forces DO=true (\"Offload "
            "optimizer is valid only if $DO=true\"); "
            "training.use_distributed_optimizer=true") in err
    assert "-do-true-" in tree["output"]["name"]  # NAME is built after the script's override
    status, tree, err = migrate(tmp_path, DO="false", OPTIMIZER_OFFLOAD="false")
    assert tree["training"]["use_distributed_optimizer"] is False
    assert tree["memory"]["optimizer_offload"] == "none"
    assert not any(line.startswith("OPTIMIZER_OFFLOAD=") for line in err)


def test_env_dsw_is_one_node_of_16_ppu(tmp_path):
    status, tree, err = migrate(tmp_path, env={"WORLD_SIZE": "4"}, ENV="dsw")
    assert status == 0 and tree["cluster"]["num_workers"] == 16  # dsw ignores WORLD_SIZE
    assert plan_of(tmp_path).data_parallel_size == 16


def test_env_dlc_takes_world_size_nodes(tmp_path):
    status, tree, err = migrate(tmp_path, env={"WORLD_SIZE": "4"}, ENV="dlc")
    assert status == 0 and tree["cluster"]["num_workers"] == 64
    assert plan_of(tmp_path).data_parallel_size == 64
    status, tree, err = migrate(tmp_path, env={}, ENV="dlc")
    assert status == 2 and "WORLD_SIZE" in err[0] and "ENV=dlc" in err[0]
    status, tree, err = migrate(tmp_path, ENV="k8s")
    assert status == 2 and "ENV ($1)='k8s'" in err[0]


def test_full_recompute_layers_must_divide_the_stage(tmp_path):
    status, tree, err = migrate(tmp_path, env={"MP_AC_LAYERS": "3"}, AC="full")
    assert status == 2  # 28 layers / PP 1 = 28, 28 % 3 = 1
    assert "the num layers per pp rank must be a multiple of the recompute layers." in err[0]
    status, tree, err = migrate(tmp_path, env={"MP_AC_LAYERS": "3"}, AC="full", PP="2")
    assert status == 2  # 28 / 2 = 14, 14 % 3 = 2
    status, tree, err = migrate(tmp_path, env={"MP_AC_LAYERS": "7"}, AC="full", PP="2")
    assert status == 0, err
    assert tree["memory"] == {"recompute": "full", "recompute_method": "uniform",
                              "recompute_num_layers": 7, "optimizer_offload": "none"}


def test_virtual_pipeline_packing_and_raw_sft_data(tmp_path):
    env = {"MP_VP": "7", "MP_DATASET_TYPE": "raw", "MP_SFT_PACKING": "true"}
    train, valid = "/data/alpaca_zh-qwen-train.json", "/data/alpaca_zh-qwen-valid.json"
    status, tree, err = migrate(tmp_path, env=env, PP="2", SFT="true",
                                DATASET_PATH=train, VALID_DATASET_PATH=valid,
                                TRAIN_TOKENS_OR_ITERS="2000", WARMUP_TOKENS_OR_ITERS="50")
    assert status == 0, err
    assert tree["parallel"]["num_layers_per_virtual_pipeline_stage"] == 7
    assert tree["data"] == {"dataset": "sft", "data_path": [train], "valid_data_path": [valid],
                            "tokenizer": CKPT, "packing": True}
    t = tree["training"]
    assert (t["train_iters"], t["lr_warmup_iters"], t["lr_decay_iters"]) == (2000, 50, 1950)
    assert tree["checkpoint"]["finetune"] is True
    assert tree["output"]["name"].startswith("finetune-mcore-qwen2.5-7B-")
    assert tree["output"]["name"].endswith("-ti-2000-wi-50")
    assert ("PAD_LEN=4096 unused: with MP_SFT_PACKING=true rows are SEQ_LEN long; "
            "data.max_padding_length not set") in err
    plan = plan_of(tmp_path)
    assert plan.virtual_pipeline_model_parallel_size == 2 and plan.packed_sequences
    # raw data without packing: padded to PAD_LEN, the length the model then trains on
    status, tree, err = migrate(tmp_path, env={"MP_DATASET_TYPE": "raw"}, SFT="true",
                                PAD_LEN="2048", TRAIN_TOKENS_OR_ITERS="2000",
                                WARMUP_TOKENS_OR_ITERS="50")
    assert status == 0 and tree["data"]["max_padding_length"] == 2048
    assert "packing" not in tree["data"] and plan_of(tmp_path).seq_length == 2048


def test_fl_false_is_fused_attention(tmp_path):
    status, tree, err = migrate(tmp_path, FL="false")
    assert status == 0 and tree["training"]["attention_backend"] == "fused"
    assert not any(line.startswith("FL=") for line in err)
    status, tree, err = migrate(tmp_path, FL="yes")
    assert tree["training"]["attention_backend"] == "auto"
    assert any(line.startswith("FL=yes is neither true nor false") for line in err)


def test_fp16_keeps_query_key_layer_scaling(tmp_path):
    status, tree, err = migrate(tmp_path, PR="fp16")
    assert status == 0 and tree["training"]["precision"] == "fp16"
    assert tree["training"]["apply_query_key_layer_scaling"] is True
    assert any(line.startswith("PR=fp16: the script adds --apply-query-key-layer-scaling")
               for line in err)


def test_stock_script_keeps_the_overlap_options(tmp_path):
    out = tmp_path / "run.yaml"
    proc = cli("--script", "run_mcore_qwen.sh", "-o", str(out), "--", *arguments())
    assert proc.returncode == 0
    err = proc.stderr
    tree = yaml.safe_load(out.read_text())
    assert tree["parallel"]["overlap_grad_reduce"] is True
    assert tree["parallel"]["overlap_param_gather"] is True
    assert "never passes it to torchrun" not in err


def test_unknown_model_size_lists_the_presets(tmp_path):
    status, _, err = migrate(tmp_path, MODEL_SIZE="9B")
    assert status == 2 and "MODEL_SIZE ($2)='9B'" in err[0] and "7B" in err[0]


def test_plan_problems_name_the_argument(tmp_path):
    status, _, err = migrate(tmp_path, GLOBAL_BATCH_SIZE="250")
    assert status == 2
    text = "\n".join(err)
    assert "global_batch_size 250 is not divisible" in text
    assert "GLOBAL_BATCH_SIZE ($4)" in text and "BATCH_SIZE ($3)" in text
    assert not (tmp_path / "run.yaml").exists()  # nothing written


# Qwen/Qwen2.5-7B config.json (the architecture fields; transformers-4 spelling)
QWEN2_5_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
              "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
              "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
              "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
              "tie_word_embeddings": False, "use_sliding_window": False, "torch_dtype": "bfloat16"}


def test_hugging_face_checkpoint_is_loaded_directly(tmp_path):
    hf = tmp_path / "Qwen2.5-7B"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN2_5_7B))
    status, tree, err = migrate(tmp_path, PRETRAIN_CHECKPOINT_PATH=str(hf))
    assert status == 0, err
    assert tree["checkpoint"]["pretrained"] == str(hf)
    assert "load" not in tree["checkpoint"] and "finetune" not in tree["checkpoint"]
    assert any(line.startswith(f"PRETRAIN_CHECKPOINT_PATH={hf} is a Hugging Face model directory")
               and "checkpoint.pretrained loads its weights directly" in line for line in err)
    # the preset (MODEL_SIZE=7B) is checked against config.json
    (hf / "config.json").write_text(json.dumps({**QWEN2_5_7B, "num_hidden_layers": 32}))
    status, tree, err = migrate(tmp_path, PRETRAIN_CHECKPOINT_PATH=str(hf))
    assert status == 2
    assert "model.num_layers=28 but num_hidden_layers gives 32" in "\n".join(err)
    status, tree, err = migrate(tmp_path, PRETRAIN_CHECKPOINT_PATH="none")
    assert status == 0 and "load" not in tree["checkpoint"] and "finetune" not in tree["checkpoint"]
    assert not any(line.startswith("PRETRAIN_CHECKPOINT_PATH") for line in err)


def test_activation_offload_takes_mp_ac_layers(tmp_path):
    status, tree, err = migrate(tmp_path, env={"MP_AC_LAYERS": "2"}, AC="offload")
    assert status == 0, err
    assert tree["memory"]["activation_offload_layers"] == 2
    assert tree["memory"]["recompute"] == "none"
    assert any(line.startswith("AC=offload: memory.activation_offload_layers=2") for line in err)


# --- run_mcore_qwen3.sh (examples/qwen3): 27 arguments, ETP and EP after CP -----------------

QWEN3 = {**REFERENCE, "MODEL_SIZE": "A3B", "GLOBAL_BATCH_SIZE": "32", "SEQ_LEN": "1024",
         "PAD_LEN": "1024", "TP": "2", "ETP": "1", "EP": "8", "AC": "sel",
         "PRETRAIN_CHECKPOINT_PATH": "none", "TRAIN_TOKENS_OR_ITERS": "1000000000",
         "WARMUP_TOKENS_OR_ITERS": "10000000"}
QWEN3_MOE_KEYS = {"num_moe_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 768,
                  "moe_aux_loss_coeff": 0.001, "moe_norm_topk_prob": True, "kv_channels": 128,
                  "qk_layernorm": True, "add_qkv_bias": False}


def qwen3_arguments(**changes) -> list[str]:
    values = {**QWEN3, **changes}
    return [values[name] for name in pai_migration.QWEN3_ARGUMENTS]


def migrate_qwen3(tmp_path, env=None, script="run_mcore_qwen3.sh", **changes):
    """As migrate, for run_mcore_qwen3.sh (``script``: its name or the path of a copy)."""
    out = tmp_path / "run.yaml"
    out.unlink(missing_ok=True)
    try:
        migrated = pai_migration.migrate_launch(qwen3_arguments(**changes), env or {},
                                                script=str(script), output=out)
    except MigrationError as err:
        return 2, None, str(err).splitlines()
    return 0, yaml.safe_load(out.read_text()), migrated.notes


def test_qwen3_moe_launch_line_maps_the_expert_settings(tmp_path):
    values = {**QWEN3}
    lines = [f"{v} \\" for v in (values[n] for n in pai_migration.QWEN3_ARGUMENTS)]
    script = tmp_path / "run_dsw_a3b.sh"
    script.write_text("cd examples/qwen3 && \\\nsh run_mcore_qwen3.sh \\\n" +
                      "\n".join(lines).removesuffix(" \\") + "\n")
    out = tmp_path / "a3b.yaml"
    proc = cli(str(script), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    tree = yaml.safe_load(out.read_text())
    assert tree["model"]["preset"] == "qwen3-30B-A3B"
    assert {k: tree["model"][k] for k in QWEN3_MOE_KEYS} == QWEN3_MOE_KEYS
    assert "num_layers" not in tree["model"]  # the branch's 48 layers are the preset's
    p = tree["parallel"]
    assert (p["expert_model_parallel_size"], p["expert_tensor_parallel_size"],
            p["moe_token_dispatcher_type"]) == (8, 1, "alltoall")
    assert p["overlap_grad_reduce"] is False  # the script never passes comm_overlap_option
    assert tree["training"]["weight_decay"] == 0.01
    assert tree["output"]["name"].startswith("pretrain-mcore-qwen3-moe-megatron-A3B-lr-1e-5-")
    text = out.read_text()
    assert "expert_model_parallel_size: 8  # EP (${14}): --expert-model-parallel-size 8" in text
    err = proc.stderr.splitlines()
    assert any(line.startswith("--moe-grouped-gemm: mapped by design") for line in err)
    assert any(line.startswith("--moe-layer-freq ([1]*48): mapped by design") for line in err)
    dry = dry_run(out)
    tc = dry["megatron"]["TransformerConfig"]
    assert (tc["num_moe_experts"], tc["moe_router_topk"],
            tc["moe_ffn_hidden_size"]) == (128, 8, 768)
    assert tc["expert_model_parallel_size"] == 8 and tc["moe_aux_loss_coeff"] == 0.001
    assert tc["kv_channels"] == 128 and tc["qk_layernorm"] is True
    # 1e9 tokens / 32 / 1024 = 30517 (30517.6), 1e7 / 32 / 1024 = 305 (305.2)
    assert (dry["plan"]["train_iters"], dry["plan"]["lr_warmup_iters"]) == (30517, 305)


@pytest.mark.parametrize("size,preset,layers", [("0.6B", "qwen3-0.6B", 28),
                                                ("32B", "qwen3-32B", 64)])
def test_qwen3_dense_sizes_take_their_preset_and_no_experts(tmp_path, size, preset, layers):
    status, tree, err = migrate_qwen3(tmp_path, MODEL_SIZE=size, TP="1", env={"MP_AC_LAYERS": "2"},
                                      AC="full")
    assert status == 0, err
    assert tree["model"]["preset"] == preset and tree["model"]["kv_channels"] == 128
    assert not any(k.startswith("moe_") or k == "num_moe_experts" for k in tree["model"])
    assert not any("expert" in k or "moe" in k for k in tree["parallel"])
    assert f"EP=8 unused: MODEL_SIZE={size} is dense (the script passes no MoE options)" in err
    assert load(tmp_path / "run.yaml").model.num_layers == layers
    assert tree["memory"]["recompute_num_layers"] == 2  # the branch's layers: even by 2
    # the full-recompute check divides the branch's layers: 28 or 64 by 3 leaves 1
    status, _, err = migrate_qwen3(tmp_path, MODEL_SIZE=size, TP="1", env={"MP_AC_LAYERS": "3"},
                                   AC="full")
    assert status == 2 and f"({layers} layers / PP 1) % 3 = 1" in err[0]


def test_qwen3_a22b_is_the_235b_preset(tmp_path):
    status, tree, err = migrate_qwen3(tmp_path, MODEL_SIZE="A22B", ENV="dlc", TP="4", PP="2",
                                      EP="16", env={"WORLD_SIZE": "8"})
    assert status == 0, err
    assert tree["model"]["preset"] == "qwen3-235B-A22B"
    assert tree["model"]["moe_ffn_hidden_size"] == 1536
    assert tree["parallel"]["expert_model_parallel_size"] == 16
    assert tree["cluster"]["num_workers"] == 128


def test_qwen3_arguments_are_named_by_their_position(tmp_path):
    status, _, err = migrate_qwen3(tmp_path, EP="eight")
    assert status == 2 and err[0].startswith("EP (${14})='eight'")
    status, _, err = migrate_qwen3(tmp_path, EP="3")  # 128 experts / EP 3
    text = "\n".join(err)
    assert status == 2 and "num_moe_experts 128 is not divisible by EP 3" in text
    assert "EP (${14})" in text
    status, _, err = migrate_qwen3(tmp_path, SP="false")  # MoE at TP 2 needs SP
    assert status == 2 and "sequence_parallel" in "\n".join(err) and "SP (${15})" in "\n".join(err)
    proc = cli("--script", "run_mcore_qwen3.sh", "--", *arguments())  # the Qwen2.5 25
    assert proc.returncode == 2
    assert "25 arguments, run_mcore_qwen3.sh reads 27; missing: WARMUP_TOKENS_OR_ITERS " \
           "OUTPUT_BASEPATH" in proc.stderr
    status, _, err = migrate_qwen3(tmp_path, MODEL_SIZE="7B")
    assert status == 2 and "MODEL_SIZE ($2)='7B'" in err[0] and "A3B" in err[0]


def test_qwen3_offload_fraction_uneven_pipeline_and_fp8(tmp_path):
    status, tree, err = migrate_qwen3(tmp_path, OPTIMIZER_OFFLOAD="0.5", DO="false")
    assert status == 0, err
    assert tree["memory"]["optimizer_offload"] == "static"
    assert tree["memory"]["optimizer_offload_fraction"] == 0.5
    assert tree["training"]["use_distributed_optimizer"] is True
    status, _, err = migrate_qwen3(tmp_path, OPTIMIZER_OFFLOAD="static")
    assert status == 2 and err[0].startswith("OPTIMIZER_OFFLOAD (${20})='static'")
    status, _, err = migrate_qwen3(tmp_path, env={"MP_PP0_LAYERS": "10"})
    assert status == 2 and "uneven pipeline split must be used when PP > 1" in err[0]
    status, _, err = migrate_qwen3(tmp_path, env={"MP_PP0_LAYERS": "11"}, PP="3")
    assert status == 2 and "(48 layers - 11) % (PP 3 - 1) = 1" in err[0]
    status, tree, err = migrate_qwen3(tmp_path, env={"MP_PP0_LAYERS": "11"}, PP="2")
    assert status == 0, err  # 37 % 1 = 0; ray_ppu splits 48 evenly
    assert any(line.startswith("MP_PP0_LAYERS=11: the script gives the first pipeline stage 11")
               for line in err)
    status, tree, err = migrate_qwen3(tmp_path, PR="fp8")
    assert status == 0 and tree["training"]["precision"] == "fp8"
    assert any("--fp8-recipe blockwise" in line and "not reproduced" in line for line in err)


# A user's copy of run_mcore_qwen3.sh: only its MODEL_SIZE branches are read.
QWEN3_COPY = """#!/bin/bash
MODEL_SIZE=$2
ETP=${{13}}
EP=${{14}}
if [ $MODEL_SIZE = 8B ]; then
    NUM_LAYERS=36
    moe_options=""
elif [ $MODEL_SIZE = A3B ]; then
    NUM_LAYERS=48
    HIDDEN_SIZE=2048
    NUM_ATTENTION_HEADS=32
    INTERMEDIATE_SIZE=6144
    MOE_INTERMEDIATE_SIZE=768
    MAX_POSITION_EMBEDDINGS=40960
    VOCAB_SIZE=151936
    NUM_KEY_VALUE_HEADS=4
    ROPE_THETA=1000000
    NUM_EXPERTS=128
    RMS_NORM_EPS=1e-6
    moe_options=" \\
        --moe-grouped-gemm \\
        --moe-router-topk 8 \\
        --num-experts ${{NUM_EXPERTS}} \\
        --expert-tensor-parallel-size ${{ETP}} \\
        --expert-model-parallel-size ${{EP}} \\
        --moe-ffn-hidden-size ${{MOE_INTERMEDIATE_SIZE}} \\
        {moe}
        "
    tie_option="--untie-embeddings-and-output-weights"
    gqa_options=" \\
        --group-query-attention \\
        --num-query-groups ${{NUM_KEY_VALUE_HEADS}}"
fi
echo "the rest of the script is not read"
"""
STOCK_MOE = ("--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss "
             "--moe-aux-loss-coeff 0.001 --moe-layer-freq '([1]*48)'")


def write_copy(tmp_path, moe: str):
    path = tmp_path / "run_mcore_qwen3.sh"
    path.write_text(QWEN3_COPY.format(moe=moe))
    return path


def test_qwen3_copy_with_the_stock_moe_options_matches_the_published_script(tmp_path):
    status, published, _ = migrate_qwen3(tmp_path)
    assert status == 0
    status, tree, err = migrate_qwen3(tmp_path, script=write_copy(tmp_path, STOCK_MOE))
    assert status == 0, err
    assert tree["model"] == published["model"] and tree["parallel"] == published["parallel"]
    assert not any("not reproduced" in line or "unsupported" in line for line in err)
    status, tree, err = migrate_qwen3(tmp_path, script=write_copy(
        tmp_path, STOCK_MOE + " --moe-router-pre-softmax"))
    assert status == 0 and tree["model"]["moe_norm_topk_prob"] is False
    status, tree, err = migrate_qwen3(tmp_path, script=write_copy(
        tmp_path, STOCK_MOE.replace("alltoall", "allgather")))
    assert status == 0 and tree["parallel"]["moe_token_dispatcher_type"] == "allgather"
    # 8B's branch of the copy sets no HIDDEN_SIZE: the script would pass --hidden-size ''
    status, _, err = migrate_qwen3(tmp_path, script=tmp_path / "run_mcore_qwen3.sh",
                                   MODEL_SIZE="8B")
    assert status == 2 and "HIDDEN_SIZE is not set" in err[0]
    status, _, err = migrate_qwen3(tmp_path, script=tmp_path / "run_mcore_qwen3.sh",
                                   MODEL_SIZE="A22B")
    assert status == 2 and "has no [ $MODEL_SIZE = A22B ] branch" in err[0]


@pytest.mark.parametrize("moe,named", [
    ("--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.001",
     "--moe-router-load-balancing-type sinkhorn"),
    ("--moe-token-dispatcher-type alltoall --moe-layer-freq '([0]+[1]*46+[0])'",
     "--moe-layer-freq ([0]+[1]*46+[0])"),
    ("--moe-layer-freq 2", "--moe-layer-freq 2"),
    ("--moe-shared-expert-intermediate-size 512", "--moe-shared-expert-intermediate-size 512"),
])
def test_qwen3_unsupported_moe_values_are_named(tmp_path, moe, named):
    status, tree, err = migrate_qwen3(tmp_path, script=write_copy(tmp_path, moe))
    assert status == 0, err
    line = next(line for line in err if line.startswith(named))
    assert "not reproduced" in line and "run_mcore_qwen3.sh, MODEL_SIZE=A3B branch" in line
    if "freq" in named:
        dense = "2 of 48 layers dense (layers 0, 47)" if "[0]" in named else \
            "24 of 48 layers dense"
        assert dense in line


@pytest.mark.parametrize("moe,named", [
    ("--moe-token-dispatcher-type flex", "--moe-token-dispatcher-type 'flex'"),
    ("--moe-layer-freq '([1]*47)'", "--moe-layer-freq ([1]*47): 47 entries for 48 layers"),
    ("--moe-layer-freq '__import__(os)'", "--moe-layer-freq '__import__(os)': expected"),
    ("--moe-router-topk eight", "--moe-router-topk 'eight': expected an integer"),
])
def test_qwen3_moe_values_no_run_could_match_are_errors(tmp_path, moe, named):
    status, _, err = migrate_qwen3(tmp_path, script=write_copy(tmp_path, moe))
    assert status == 2 and named in err[0], err
    assert "run_mcore_qwen3.sh, MODEL_SIZE=A3B branch" in err[0]


def test_qwen3_load_balancing_none_drops_the_aux_loss(tmp_path):
    status, tree, err = migrate_qwen3(tmp_path, script=write_copy(
        tmp_path, "--moe-router-load-balancing-type none --moe-aux-loss-coeff 0.01"))
    assert status == 0, err
    assert tree["model"]["moe_aux_loss_coeff"] == 0.0
    assert any(line.startswith("--moe-router-load-balancing-type none with --moe-aux-loss-coeff "
                               "0.01") for line in err)
    # left out: Megatron's defaults (allgather dispatcher, no aux loss) rather than the preset's
    status, tree, err = migrate_qwen3(tmp_path, script=write_copy(tmp_path, ""))
    assert status == 0, err
    assert tree["parallel"]["moe_token_dispatcher_type"] == "allgather"
    assert tree["model"]["moe_aux_loss_coeff"] == 0.0
    assert any(line.startswith("MODEL_SIZE=A3B: the script sets moe_aux_loss_coeff 0.0") for
               line in err)


# --- a deepspeed + Hugging Face Trainer launch (Qwen-VL's finetune/finetune_lora_ds.sh) ------


def trainer_script(tmp_path, model, procs=16, accumulate=4, extra="", deepspeed="zero2.json"):
    """A launch shaped like Qwen-VL's finetune_lora_ds.sh (in our words): torchrun's options in
    a quoted multi-line variable, a value computed with backquotes it never uses, the trainer's
    options as --name value pairs and bare flags."""
    (tmp_path / "ds").mkdir(exist_ok=True)
    (tmp_path / "ds" / "zero2.json").write_text(json.dumps(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}))
    records = tmp_path / "records.json"
    records.write_text(json.dumps([{"id": i} for i in range(1000)]))
    script = tmp_path / "ds" / "finetune_lora_ds.sh"
    script.write_text(f"""#!/bin/bash
# LoRA on a vision-language model, one node
export CUDA_DEVICE_MAX_CONNECTIONS=1
WHERE=`pwd`
PER_NODE={procs}
MODEL="{model}"
RECORDS={records}
LAUNCHER="
    --nproc_per_node $PER_NODE \\
    --nnodes 1 \\
    --master_port 6001
"
torchrun $LAUNCHER finetune.py \\
    --model_name_or_path $MODEL \\
    --data_path $RECORDS \\
    --bf16 True \\
    --output_dir lora_out \\
    --num_train_epochs 5 \\
    --per_device_train_batch_size 2 \\
    --per_device_eval_batch_size 1 \\
    --gradient_accumulation_steps {accumulate} \\
    --evaluation_strategy "no" \\
    --save_steps 1000 \\
    --save_total_limit 10 \\
    --learning_rate 1e-5 \\
    --weight_decay 0.1 \\
    --adam_beta2 0.95 \\
    --warmup_ratio 0.01 \\
    --lr_scheduler_type "cosine" \\
    --logging_steps 1 \\
    --report_to "none" \\
    --model_max_length 2048 \\
    --lazy_preprocess True \\
    --use_lora \\
    --gradient_checkpointing {extra} \\
    --deepspeed {deepspeed}
""")
    return script


def test_hf_trainer_migration_trains_the_trainers_learning_rates(tmp_path):
    """At every step the migrated run's learning rate is the one transformers' cosine schedule
    with warmup gives the Trainer's step (the last one too: above 0, as the Trainer's is)."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from ray_ppu.plan import build_plan
    from ray_ppu.plan.derived import lr_at

    out = tmp_path / "run.yaml"
    proc = cli("--script", str(trainer_script(tmp_path, qwen_vl_directory(tmp_path))),
               "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    cfg = load(out, [])
    plan = build_plan(cfg)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.training.lr)
    theirs = get_cosine_schedule_with_warmup(optimizer, plan.lr_warmup_iters, plan.train_iters)
    for iteration in range(1, plan.train_iters + 1):  # the Trainer's step iteration - 1
        assert lr_at(cfg, plan, iteration) == pytest.approx(theirs.get_last_lr()[0],
                                                            rel=1e-9, abs=1e-15), iteration
        optimizer.step()
        theirs.step()
    assert lr_at(cfg, plan, plan.train_iters) > 0


def qwen_vl_directory(tmp_path):
    """A Qwen2.5-VL-7B-Instruct directory as far as the config check reads it (config.json)."""
    from ray_ppu.hf.qwen_vl import qwen_vl_to_hf

    cfg = load(None, ["model.preset=qwen2.5-vl-7B"])
    directory = tmp_path / "Qwen2.5-VL-7B-Instruct"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(qwen_vl_to_hf(cfg.model, cfg.vision,
                                                                   "bfloat16")))
    return directory


def test_hf_trainer_lora_launch_maps_the_seed_setting(tmp_path):
    """16 processes × mbs 2 × 4 accumulation = 128 per step; 5 epochs of 1000 records:
    ⌈⌈1000 / 2⌉ / 16⌉ = 32 batches per rank, 8 updates per epoch, 40 steps, warmup ⌈0.4⌉ = 1;
    ZeRO-2 → the distributed optimizer; finetune.py's LoRA defaults; what has no setting
    named. The YAML dry-runs through pretrain.py with the image FLOPs in the plan."""
    model = qwen_vl_directory(tmp_path)
    out = tmp_path / "run.yaml"
    proc = cli("--script", str(trainer_script(tmp_path, model)), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    tree = yaml.safe_load(out.read_text())
    t = tree["training"]
    assert tree["model"]["preset"] == "qwen2.5-vl-7B"
    assert tree["checkpoint"]["pretrained"] == str(model) == tree["data"]["tokenizer"]
    assert (t["micro_batch_size"], t["global_batch_size"], t["seq_length"]) == (2, 128, 2048)
    assert (t["train_iters"], t["lr_warmup_iters"], t["lr_decay_iters"]) == (40, 1, 40)
    assert (t["lr"], t["min_lr"], t["weight_decay"], t["adam_beta2"]) == (1e-5, 0.0, 0.1, 0.95)
    assert t["lr_decay_style"] == "cosine" and t["precision"] == "bf16"
    assert t["use_distributed_optimizer"] is True and t["eval_iters"] == 0
    assert tree["memory"]["recompute"] == "full" and tree["cluster"]["num_workers"] == 16
    assert tree["lora"] == {"enabled": True, "rank": 64, "alpha": 16.0, "dropout": 0.05,
                            "target_modules": ["linear_qkv", "linear_proj", "linear_fc1"],
                            "trainable": ["embedding", "output_layer"]}  # no "chat" in the path
    assert tree["vision"]["freeze"] == ["vision", "projector"]
    assert tree["data"]["data_path"] == [str(tmp_path / "records.json")]
    assert (tree["checkpoint"]["save_interval"], tree["checkpoint"]["keep_last"]) == (1000, 10)
    assert ("not reproduced (no ray_ppu setting): --per_device_eval_batch_size 1, "
            "--lazy_preprocess True") in proc.stderr
    assert "<img>path</img>" in proc.stderr and "Traceback" not in proc.stderr
    text = out.read_text()
    assert "16 DP × 2 mbs × 4 microbatches = 128" in text
    assert "5 epochs × max(⌈⌈1000 records / 2⌉ / 16⌉ // 4, 1) = 5 × 8 = 40" in text
    dry = subprocess.run([sys.executable, str(REPO / "entrypoints" / "pretrain.py"), "--config",
                          str(out), "--dry-run", "--plan-only"], capture_output=True, text=True,
                         timeout=120)
    assert dry.returncode == 0, dry.stderr[-3000:]
    plan = json.loads(dry.stdout)["plan"]
    assert plan["global_batch_size"] == 128 and plan["flops_per_image"] > 0


def test_hf_trainer_qwen_vl_chat_launch_becomes_qwen25_vl(tmp_path):
    """Qwen-VL-Chat has no ray_ppu model: qwen2.5-vl-7B from the hub name, noted; a chat model
    trains no embeddings beside the adapters; --max_steps counts over epochs; 8 processes ×
    2 × 8 = 128; a DeepSpeed JSON not on this machine gives its stage by its name."""
    script = trainer_script(tmp_path, "Qwen/Qwen-VL-Chat", procs=8, accumulate=8,
                            extra="--max_steps 300", deepspeed="configs/ds_zero2.json")
    migrated = pai_migration.migrate_launch([], {}, str(script))
    tree = yaml.safe_load(migrated.text)
    assert tree["model"]["preset"] == "qwen2.5-vl-7B"
    assert tree["checkpoint"]["pretrained"] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert "trainable" not in tree["lora"]
    assert tree["training"]["global_batch_size"] == 128 and tree["training"]["train_iters"] == 300
    assert tree["cluster"]["num_workers"] == 8
    notes = migrated.notes
    assert any(n.startswith("--model_name_or_path Qwen/Qwen-VL-Chat: Qwen-VL") for n in notes)
    assert any("ZeRO stage 2 taken from its name" in n for n in notes)
    assert any(n.startswith("checkpoint.pretrained=Qwen/Qwen2.5-VL-7B-Instruct is not a model "
                            "directory on this machine") for n in notes)
    assert any("ray_ppu places one worker per PPU" in n for n in notes)


@pytest.mark.parametrize("extra,message", [
    ("--q_lora True", "--q_lora (finetune.py): a GPTQ 4-bit base"),
    ("--lora_target_modules qkv_proj", "qkv_proj is not a linear ray_ppu adapts"),
    ("--per_device_train_batch_size two", "--per_device_train_batch_size (finetune.py)='two'"),
])
def test_hf_trainer_launch_problems_name_the_option(tmp_path, extra, message):
    script = trainer_script(tmp_path, "Qwen/Qwen2.5-VL-3B-Instruct", extra=extra)
    with pytest.raises(MigrationError, match=re.escape(message)):
        pai_migration.migrate_launch([], {}, str(script))


def test_hf_trainer_epochs_need_the_records(tmp_path):
    script = trainer_script(tmp_path, "Qwen/Qwen2.5-VL-7B-Instruct")
    (tmp_path / "records.json").unlink()
    proc = cli("--script", str(script))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--data_path (finetune.py)=" in proc.stderr and "--max_steps" in proc.stderr
