"""What a new user trips on, each case as they meet it: a dry run that checks what the launch
checks (and writes nothing), a plan too big for the device refused with a layout that fits,
every size's sign rule (read from its docstring), both forms of a length, one ``error:`` line
where tracebacks were, a quiet exit into a closed pipe, and docs that match the code (the
README's commands and keys, the shipped migration examples, the presets users type).

Most checks run in this process (load, plan, the local checks): the subprocesses are the entry
points as users run them, one per behaviour.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import typing
import warnings

import pytest
import yaml

from conftest import REPO
from ray_ppu.config import schema
from ray_ppu.config.loader import load
from ray_ppu.config.reference import field_docs
from ray_ppu.errors import ConfigError
from ray_ppu.launch import local_checks
from ray_ppu.launch.output import absolute_paths
from ray_ppu.plan import build_plan
from ray_ppu.plan.memory import memory_plan
from ray_ppu.plan.sizes import bounds

PRETRAIN = REPO / "entrypoints" / "pretrain.py"
CONFIG_7B = REPO / "entrypoints" / "configs" / "qwen2.5-7b-pretrain.yaml"
DEMO = REPO / "entrypoints" / "configs" / "demo.yaml"


def _run(script, *args, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "entrypoints" / script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=180,
                          env=None if env is None else {**os.environ, **env})


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


# --- the dry run checks what the launch checks ---------------------------------------------------


def test_dry_run_of_a_missing_corpus_exits_2_with_the_launchs_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    args = ["--config", str(DEMO), f"data.data_path=[{tmp_path / 'nowhere'}]", f"output.dir={out}"]
    proc = _run("pretrain.py", *args, "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert f"error: unusable idxmap corpus:" in proc.stderr, proc.stderr
    assert f"{tmp_path / 'nowhere'}.bin: missing" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["problems"], "the JSON names the problem too"
    assert not out.exists(), "a dry run writes nothing into output.dir"
    # the launch refuses with the same words, before any Ray or output directory
    from ray_ppu.launch.launcher import launch

    cfg = absolute_paths(load(DEMO, args[2:]))
    with pytest.raises(ConfigError) as info:
        launch(cfg, build_plan(cfg))
    assert f"error: {info.value}".splitlines()[0] in proc.stderr
    assert not out.exists()


def test_the_demos_settings_on_a_users_corpus_do_not_build_the_demo_corpus_there(tmp_path):
    """pretrain.py without --config but with data.data_path is the demo's settings on the
    user's corpus: a missing one is the launch's one line, and nothing is written beside it
    (the demo's stdlib corpus, tokenizer and raw shards were built in the user's directory)."""
    users = tmp_path / "mine"
    users.mkdir()
    proc = _run("pretrain.py", f"data.data_path=[{users / 'corpus'}]",
                f"output.dir={tmp_path / 'out'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _error_lines(proc.stderr) == ["error: unusable idxmap corpus:"], proc.stderr[-2000:]
    assert f"{users / 'corpus'}.bin: missing" in proc.stderr
    assert list(users.iterdir()) == [] and not (tmp_path / "out").exists()


def test_an_unreachable_ray_address_and_a_ray_that_cannot_start_are_one_line(tmp_path):
    """RAY_ADDRESS naming no cluster: the dry run and the launch stop after
    cluster.connect_timeout_s with the address (they hung for minutes on Ray's GCS retries);
    a local Ray that cannot start: Ray's reason in one line (it was Ray's traceback)."""
    import socket

    # a port this test holds, bound but not listening: a connection to it is refused, and no
    # other process (a gloo or Ray listener of a run beside the tests) can take it meanwhile
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{holder.getsockname()[1]}"
    args = [f"output.dir={tmp_path / 'out'}", "cluster.connect_timeout_s=2"]
    (tmp_path / "a_file").write_text("")
    script = str(REPO / "entrypoints" / "pretrain.py")
    env = {"dry": {"RAY_ADDRESS": address}, "launch": {"RAY_ADDRESS": address},
           "start": {"RAY_TMPDIR": str(tmp_path / "a_file" / "ray")}}
    procs = {name: subprocess.Popen(  # at once: most of each is importing
        [sys.executable, script, *args, *(["--dry-run"] if name == "dry" else [])], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **extra})
        for name, extra in env.items()}
    done = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=180)
            done[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    finally:
        holder.close()
    for proc in (done["dry"], done["launch"]):
        assert proc.returncode == 2, proc.stderr[-2000:]
        (line,) = [l for l in proc.stderr.splitlines() if "cannot reach" in l]
        assert line.endswith(f"cannot reach the Ray cluster at RAY_ADDRESS={address}: "
                             f"Connection refused for 2 s (cluster.connect_timeout_s); is it "
                             f"running there (`ray status` on its head node), or unset "
                             f"RAY_ADDRESS to start a local Ray"), line
        assert "Traceback" not in proc.stderr
    proc = done["start"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _error_lines(proc.stderr) == [
        f"error: Ray could not start on this machine: [Errno 20] Not a directory: "
        f"'{tmp_path / 'a_file' / 'ray'}' (on a loaded machine or with /tmp/ray full, try "
        f"again; or start Ray with `ray start --head` and set RAY_ADDRESS)"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_local_checks_name_missing_sft_files_and_tokenizer_together(tmp_path):
    cfg = absolute_paths(load(REPO / "entrypoints" / "configs" / "qwen2.5-7b-sft.yaml", [
        f"data.data_path=[{tmp_path / 'train.jsonl'}]", f"data.valid_data_path=[]",
        f"data.tokenizer={tmp_path / 'tok'}", "training.eval_iters=0", "checkpoint.pretrained=null",
        f"output.dir={tmp_path / 'out'}", "cluster.device=cpu"]))
    with pytest.raises(ConfigError) as info:
        local_checks.check(cfg, build_plan(cfg))
    message = str(info.value)
    assert message.startswith("the run cannot start:"), message
    assert "data.data_path:" in message and "train.jsonl" in message
    assert f"data.tokenizer: tokenizer directory {tmp_path / 'tok'} does not exist" in message


@pytest.mark.parametrize("config", sorted((REPO / "entrypoints" / "configs").glob("*.yaml")),
                         ids=lambda path: path.stem)
def test_every_shipped_config_plans_from_the_config_alone(config, tmp_path):
    """--plan-only is for planning where the files are not (before renting PPUs): no data,
    tokenizer or checkpoint.pretrained directory is needed, the preset stands in for its
    config.json, and the dry run says what it left unchecked."""
    cfg = absolute_paths(load(config, ["data.data_path=[]", "data.valid_data_path=[]",
                                       "data.tokenizer=null", f"output.dir={tmp_path / 'out'}"],
                              files=False))
    plan = build_plan(cfg, files=False)
    local_checks.check(cfg, plan, files=False)
    assert plan.world_size >= 1 and plan.train_iters > 0
    unchecked = " ".join(local_checks.unchecked(cfg))
    assert "the training data" in unchecked and "where the run starts" in unchecked
    assert ("data.tokenizer" in unchecked) == (cfg.data.dataset == "sft")
    assert ("checkpoint.pretrained" in unchecked) == bool(cfg.checkpoint.pretrained)
    with pytest.raises(ConfigError):  # the launch still asks for what it reads
        build_plan(cfg)


def test_plan_only_without_the_pretrained_directory_needs_the_model_named(tmp_path):
    missing = tmp_path / "Qwen2.5-7B"
    with pytest.raises(ConfigError) as info:
        load(None, [f"checkpoint.pretrained={missing}"], files=False)
    assert str(info.value) == (f"--plan-only: {missing}/config.json is not here to say what "
                               f"model checkpoint.pretrained is: name it (model.preset=...)")
    assert load(None, [f"checkpoint.pretrained={missing}", "model.preset=7B"],
                files=False).model.hidden_size == 3584


def test_plan_only_of_the_vl_lora_config_needs_none_of_its_directories():
    """The shipped Qwen2.5-VL LoRA config names /mnt/... paths that are not here."""
    proc = _run("pretrain.py", "--config", str(REPO / "entrypoints" / "configs" /
                                               "qwen2.5-vl-7b-lora.yaml"), "--dry-run", "--plan-only")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["plan"]["world_size"] >= 1
    assert "not checked (--plan-only): the training data" in proc.stderr
    assert "checkpoint.pretrained (its config.json against the preset" in proc.stderr


_DRY_RUN_IMPORTS = """
import json, runpy, sys
sys.argv = [{script!r}, *sys.argv[1:]]
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as done:
    code = done.code
print(json.dumps({{"code": code, "heavy": sorted({{m.split(".")[0] for m in sys.modules}}
                                                 & {{"torch", "megatron", "transformers"}})}}))
"""


def test_a_dry_run_imports_no_torch(corpus):
    """What a dry run checks (config, plan, memory plan, the corpus and its tokens) needs no
    torch: it answers in a fraction of a second, not after torch's import (1.1 s here)."""
    proc = subprocess.run(
        [sys.executable, "-c", _DRY_RUN_IMPORTS.format(script=str(PRETRAIN)), "--dry-run",
         f"data.data_path=[{corpus}]", "data.split=80,20,0", "training.eval_iters=1",
         "cluster.device=auto"], capture_output=True, text=True, timeout=180)
    assert json.loads(proc.stdout.splitlines()[-1]) == {"code": 0, "heavy": []}, \
        proc.stderr[-2000:]


def test_a_72b_plan_on_16_devices_is_refused_with_a_layout_that_fits():
    proc = _run("pretrain.py", "--config", str(CONFIG_7B), "--dry-run", "--plan-only",
                "model.preset=72B")
    assert proc.returncode == 2
    (line,) = _error_lines(proc.stderr)
    assert ("the memory plan needs 575.6 GiB per device, over the 86.4 GiB (90 %) of a 96 GiB "
            "ppu-810e (gradients 270.9, parameters 135.4") in line
    assert "memory per device (ppu-810e, 96 GiB): 575.6 GiB" in proc.stderr  # the summary
    change = re.search(r"it fits with (.*?) \((\d+\.\d) GiB\)", line)
    assert change, line
    # the change it names does fit, through the same loader and plan
    cfg = load(CONFIG_7B, ["model.preset=72B", *change.group(1).split()])
    fitted = memory_plan(cfg, build_plan(cfg))
    assert fitted.fits and f"{fitted.total_gib:.1f}" == change.group(2)
    # the user's word wins: the device's real memory, or launch anyway
    for override in ("memory.require_fit=false", "memory.device_memory_gib=700"):
        cfg = load(CONFIG_7B, ["model.preset=72B", override])
        local_checks.check(cfg, build_plan(cfg), files=False)


# --- every size's sign rule ------------------------------------------------------------------


def _numeric(annotation) -> bool:
    args = typing.get_args(annotation) or (annotation,)
    return any(a in (int, float) for a in args)


# Numbers that are not sizes or counts: bounded both ways, with their own rules and tests.
NOT_SIZES = {"training.adam_beta1", "training.adam_beta2", "memory.optimizer_offload_fraction",
             "data.max_dropped_share",
             "model.hidden_dropout", "model.attention_dropout", "lora.dropout",
             # mappings of numbers: each value is held to its bound by the lora rules
             "lora.rank_pattern", "lora.alpha_pattern",
             # an index into the ViT's layers, negative from the end: the vision rules bound it
             "vision.feature_layer"}


def test_every_numeric_field_states_its_bound_in_its_docstring():
    hints = {f"{section}.{name}": annotation
             for section, cls in typing.get_type_hints(schema.RunConfig).items()
             for name, annotation in typing.get_type_hints(cls).items()}
    numeric = {key for key, annotation in hints.items() if _numeric(annotation)}
    assert numeric - NOT_SIZES == set(bounds()), "a numeric field without [≥ n] / [> n]"
    docs = {doc.key: doc.doc for doc in field_docs()}
    for key, (relation, bound) in bounds().items():
        assert docs[key].endswith(f"[{relation} {bound:g}]"), key  # what --help-config shows


@pytest.mark.parametrize("key", sorted(bounds()))
def test_a_size_outside_its_bound_is_a_plan_problem(key):
    relation, bound = bounds()[key]
    bad = bound - 1 if relation == "≥" else bound
    section, name = key.split(".")
    annotation = typing.get_type_hints(type(getattr(schema.RunConfig(), section)))[name]
    value = int(bad) if int in (typing.get_args(annotation) or (annotation,)) else bad
    listed = typing.get_origin(annotation) is list  # a list's items each: one bad item named
    cfg = load(DEMO, [f"{key}=[3, {int(bad)}]" if listed else f"{key}={value}"])
    with pytest.raises(ConfigError) as info:
        build_plan(cfg)
    lines = str(info.value).splitlines()
    shown = f"[3, {int(bad)}]" if listed else f"{value:g}"
    has = f" (has {int(bad)})" if listed else ""
    assert lines[1] == f"  - {key}={shown}: must be {relation} {bound:g}{has}"
    assert not any(" not divisible by " in line for line in lines)  # no arithmetic on it


def test_zero_and_negative_batch_sizes_say_must_be_at_least_one():
    with pytest.raises(ConfigError) as info:
        build_plan(load(DEMO, ["training.micro_batch_size=0", "training.global_batch_size=-256",
                               "training.seq_length=-5"]))
    assert str(info.value).splitlines()[1:] == [
        "  - training.micro_batch_size=0: must be ≥ 1",
        "  - training.global_batch_size=-256: must be ≥ 1",
        "  - training.seq_length=-5: must be ≥ 1"]


# --- one form of each length -----------------------------------------------------------------


PAIRS = [("train_iters", 100, "train_tokens", 2048000),
         ("lr_warmup_iters", 2, "lr_warmup_tokens", 4096),
         ("lr_decay_iters", 40, "lr_decay_tokens", 40960)]


@pytest.mark.parametrize("iters, n_iters, tokens, n_tokens", PAIRS)
def test_both_forms_of_a_length_in_one_file_is_an_error_naming_both(tmp_path, iters, n_iters,
                                                                    tokens, n_tokens):
    tree = yaml.safe_load(DEMO.read_text())
    tree["training"].update({iters: n_iters, tokens: n_tokens})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=rf"training.{iters}={n_iters} and training.{tokens}="
                                          rf"{n_tokens} both set in {re.escape(str(path))}"):
        load(path)
    with pytest.raises(ConfigError, match="both set on the command line"):
        load(DEMO, [f"training.{iters}={n_iters}", f"training.{tokens}={n_tokens}"])


def test_an_override_replaces_the_files_other_form_with_a_note():
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        plan = build_plan(load(CONFIG_7B, ["training.train_iters=100"]))
        demo = build_plan(load(DEMO, ["training.train_tokens=1024000"]))
    assert plan.train_iters == 100 and demo.train_iters == 1000
    assert [str(n.message) for n in notes] == [
        f"training.train_iters=100 (command line) replaces training.train_tokens=1e10 of {CONFIG_7B}",
        f"training.train_tokens=1024000 (command line) replaces training.train_iters=50 of {DEMO}"]


def test_schedule_errors_name_the_form_the_user_wrote_and_a_warmup_rounded_to_zero_is_noted():
    with pytest.raises(ConfigError) as info:
        build_plan(load(CONFIG_7B, ["training.train_tokens=null", "training.train_iters=3",
                                    "training.lr_warmup_tokens=4194304"]))
    assert "lr_warmup_tokens 4,194,304 (= 4 iterations of 1,048,576 tokens) must be below the 3 " \
           "iterations of decay" in str(info.value)
    from ray_ppu.plan.summary import summary_lines

    cfg = load(CONFIG_7B)
    plan = build_plan(cfg)
    assert plan.lr_warmup_iters == 0
    assert ("note: training.lr_warmup_tokens 1,000,000 is under one iteration (1,048,576 tokens "
            "= global_batch_size 256 × 4096): lr_warmup_iters = 0") in summary_lines(
                cfg, plan, memory_plan(cfg, plan))


# --- names users type --------------------------------------------------------------------------


@pytest.mark.parametrize("typed, preset", [("qwen2.5-7B", "7B"), ("Qwen2.5-7b", "7B"),
                                           ("7b", "7B"), ("LLAMA3.1-8b", "llama3.1-8B"),
                                           ("qwen3-30b-a3b", "qwen3-30B-A3B")])
def test_presets_accept_family_names_in_any_case(typed, preset):
    assert load(None, [f"model.preset={typed}"]).model.preset == preset


def test_a_key_in_the_wrong_section_names_its_section():
    with pytest.raises(ConfigError, match=r"unknown key 'parallel.micro_batch_size' \(it belongs "
                                          r"in training: training.micro_batch_size\)"):
        load(None, ["parallel.micro_batch_size=2"])
    with pytest.raises(ConfigError, match=r"'memory.recompute_num_layer'.*recompute_num_layers"):
        load(None, ["memory.recompute_num_layer=2"])  # the section's own near miss first


def test_shipped_configs_are_named_after_their_preset():
    for path in (REPO / "entrypoints" / "configs").glob("qwen*.yaml"):
        preset = yaml.safe_load(path.read_text())["model"]["preset"]
        assert path.name.startswith(preset.lower() + "-"), (path.name, preset)


# --- one line, not a traceback ----------------------------------------------------------------


def test_inspect_data_with_a_bad_tokenizer_directory_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for tokenizer, fact in ((tmp_path / "missing", "does not exist"),
                            (tmp_path / "empty", "has no tokenizer.json")):
        proc = _run("inspect_data.py", "--config", str(DEMO), "--tokenizer", str(tokenizer),
                    f"output.dir={tmp_path / 'out'}")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert _error_lines(proc.stderr) == [
            f"error: --tokenizer {tokenizer}: tokenizer directory {tokenizer} {fact}"]
    assert not (tmp_path / "out").exists(), "refused before the index work"


def test_generate_with_bad_token_ids_is_one_line(tmp_path):
    proc = _run("generate.py", "--checkpoint", str(tmp_path), "--token-ids", "1,2,abc")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert _error_lines(proc.stderr) == [
        "error: --token-ids 1,2,abc: 'abc' is not an integer (expected comma-separated token "
        "ids, e.g. 151644,872)"]


@pytest.mark.parametrize("script, args, fact", [
    ("report.py", ["{tmp}"], "{tmp}: no metrics.jsonl here"),
    ("from_pai_script.py", ["{tmp}/run.sh"], "{tmp}/run.sh: no such launch script"),
    ("pretrain.py", ["--config", "{tmp}/run.yaml"], "config file {tmp}/run.yaml does not exist"),
    ("pretrain.py", ["--dry-run", "training.seq_length=abc"],
     "training.seq_length='abc': expected int"),
    ("convert_checkpoint.py", ["hf-to-mcore", "--hf", "{tmp}", "--out", "{tmp}/out"],
     "{tmp}: neither a Hugging Face model directory"),
    ("preprocess_data.py", ["--input", "{tmp}/none.jsonl", "--output-prefix", "{tmp}/p",
                            "--tokenizer", "{tmp}"], "{tmp}/none.jsonl: no such file"),
])
def test_every_entry_point_says_a_user_error_in_one_line(tmp_path, script, args, fact):
    proc = _run(script, *[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert line.startswith(f"error: {fact.format(tmp=tmp_path)}"), line


def test_dry_run_into_a_closed_pipe_exits_quietly():
    """``| true`` closes the pipe before pretrain.py writes its JSON (what ``| head -1`` does to
    a longer output): SIGPIPE's status, no traceback."""
    proc = subprocess.run(["bash", "-c", f'"{sys.executable}" "{PRETRAIN}" --config "{CONFIG_7B}" '
                           f'--dry-run --plan-only | true; exit "${{PIPESTATUS[0]}}"'],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("layout: 16 workers"), proc.stderr  # the summary came first


# --- docs that match the code -----------------------------------------------------------------


def _readme_text() -> str:
    return "\n".join(p.read_text() for p in (REPO / "README.md", REPO / "cluster" / "README.md",
                                             REPO / "examples" / "README.md"))


def test_config_keys_the_readmes_name_exist():
    known = {doc.key for doc in field_docs()}
    sections = {key.split(".")[0] for key in known}
    named = set(re.findall(r"`((?:%s)\.[a-z_]+)" % "|".join(sections), _readme_text()))
    assert named and not named - known, sorted(named - known)


def test_files_the_readmes_run_exist():
    paths = set(re.findall(r"\b((?:entrypoints|examples|cluster)/[\w./-]+\.(?:py|sh|yaml|md))",
                           _readme_text()))
    assert {"examples/run_dsw_7b.sh", "examples/qwen3/run_mcore_qwen3.sh"} <= paths
    assert not [p for p in paths if not (REPO / p).exists()]


def test_the_readmes_demo_outputs_and_validation_split_are_what_the_demo_makes():
    from ray_ppu.tools.demo import stdlib_files

    readme = (REPO / "README.md").read_text()
    for output in ("config.yaml", "plan.json", "metrics.jsonl", "tensorboard/", "report.html",
                   "ray_train/", "index_cache/", "data/"):
        assert f"`{output}`" in readme, output
    # the demo corpus's files in its order; Megatron's split puts the last 2 % in validation
    names = [name for name, _ in stdlib_files(4_000_000)]  # build_demo_corpus's max_bytes
    held_out = names[round(0.98 * len(names)):]
    assert f"corpus's {len(names)} files" in readme
    assert held_out and all(re.fullmatch(r"encodings/cp\d+\.py", n) for n in held_out), held_out
    assert f"{len(held_out)} of the standard library's codec tables" in readme


def test_pretrain_help_names_every_family_and_a_complete_job_submit():
    out = _run("pretrain.py", "--help").stdout
    for family in ("Qwen2.5", "Qwen3", "Qwen3-MoE", "LLaMA-3.1", "qwen3-30B-A3B", "llama3.1-70B"):
        assert family in out
    submit = out[out.index("ray job submit"):].split("\n\n")[0]
    assert "--address" in submit and "--runtime-env cluster/runtime_env.yaml" in submit
    assert (REPO / "cluster" / "runtime_env.yaml").is_file()


def test_shipped_migration_examples_migrate(tmp_path):
    from test_migration import arguments, cli, migrate_qwen3
    from ray_ppu.tools.pai_migration.qwen3 import SIZES

    out = tmp_path / "from_example.yaml"
    proc = cli(str(REPO / "examples" / "run_dsw_7b.sh"), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert cli("--output", str(tmp_path / "run.yaml"), "--", *arguments()).returncode == 0
    assert yaml.safe_load(out.read_text()) == yaml.safe_load((tmp_path / "run.yaml").read_text())
    # the qwen3 stand-in's branches migrate as the published script's do, at every size
    stand_in = REPO / "examples" / "qwen3" / "run_mcore_qwen3.sh"
    for size in SIZES:
        dense = {} if size.startswith("A") else {"EP": "1", "TP": "1"}
        status, published, err = migrate_qwen3(tmp_path, MODEL_SIZE=size, **dense)
        assert status == 0, err
        status, ours, err = migrate_qwen3(tmp_path, script=stand_in, MODEL_SIZE=size, **dense)
        assert status == 0 and ours == published, (size, err)
