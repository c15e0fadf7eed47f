"""Preflight (ray_ppu.launch.preflight): one pinned Ray task per PPU node checks the run's paths, the
device and Transformer Engine there, before any index is built or worker placed.

All nodes of the test cluster are this machine; an unwritable place is a path under a regular
file (no user, root included, can create anything there)."""

import importlib.util
import json
import re
import time

import pytest

from conftest import SIMULATED_PPUS
from ray_ppu.launch import preflight
from ray_ppu.config.loader import load
from ray_ppu.errors import ClusterError
from ray_ppu.launch.launcher import launch
from ray_ppu.plan import build_plan
from ray_ppu.launch.output import absolute_paths

from conftest import REPO


def config(corpus, out, *extra):
    return absolute_paths(load(None, [
        f"data.data_path=[{corpus}]", f"output.dir={out}", "output.tensorboard=false",
        "cluster.device=cpu", "training.precision=fp32", "cluster.num_workers=1",
        "training.train_iters=2", "training.global_batch_size=2", "training.seq_length=32",
        "training.eval_iters=0", *extra]))


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    return path


def test_good_config_passes(ray_cluster, corpus, tmp_path):
    out = tmp_path / "new" / "run"  # created on the node by the preflight
    result = preflight.check(config(corpus, out))
    assert result["ok"] and result["problems"] == []
    [node] = result["nodes"]  # the local cluster: one node with PPU
    assert node["device"] == "cpu" and node["cuda"] is False
    assert isinstance(node["transformer_engine"], bool)
    # both directories made, the probe files gone again
    assert list(out.iterdir()) == [out / "index_cache"]
    assert list((out / "index_cache").iterdir()) == []


def test_unwritable_output_dir_is_named(ray_cluster, corpus, a_file):
    out = a_file / "run"
    with pytest.raises(ClusterError) as err:
        preflight.check(config(corpus, out))
    # one line per problem, each naming the node (IP / short id), the setting and the path
    assert re.search(rf"\n  \S+/[0-9a-f]{{8}}: output\.dir {re.escape(str(out))}: cannot "
                     rf"create the directory", str(err.value)), str(err.value)


def test_missing_idx_and_checkpoint_are_named(ray_cluster, tmp_path):
    prefix = tmp_path / "corpus_text_document"
    prefix.with_suffix(".bin").write_bytes(b"\0" * 16)  # .bin present, .idx missing
    missing_load = tmp_path / "no_such_checkpoint"
    with pytest.raises(ClusterError) as err:
        preflight.check(config(prefix, tmp_path / "run", f"checkpoint.load={missing_load}"))
    problems = str(err.value).splitlines()[1:]
    assert len(problems) == 2, problems
    assert any(f"data.data_path {prefix}.idx: missing" in p for p in problems)
    assert any(f"checkpoint.load {missing_load}: missing" in p for p in problems)


def test_fp8_without_transformer_engine_is_refused(ray_cluster, corpus, tmp_path):
    # cluster.device=auto: this machine has no CUDA device and no Transformer Engine
    cfg = config(corpus, tmp_path, "cluster.device=auto", "training.precision=fp8")
    with pytest.raises(ClusterError, match=r"training\.precision=fp8") as err:
        preflight.check(cfg)
    assert "only Transformer Engine provides" in str(err.value)


def test_launch_runs_preflight_before_anything_is_placed(ray_cluster, corpus, tmp_path, a_file):
    out = tmp_path / "run"
    cache = a_file / "index_cache"
    cfg = config(corpus, out, f"data.index_cache_dir={cache}")
    start = time.monotonic()
    with pytest.raises(ClusterError, match=f"data.index_cache_dir {cache}: cannot create"):
        launch(cfg, build_plan(cfg))
    assert time.monotonic() - start < 20
    assert not (out / "ray_train").exists()  # no worker group, no Ray Train run directory


def test_dry_run_on_a_cluster_prints_the_preflight(ray_cluster, corpus, tmp_path, capsys,
                                                    monkeypatch):
    spec = importlib.util.spec_from_file_location("pretrain_entry",
                                                  REPO / "entrypoints" / "pretrain.py")
    pretrain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain)
    # connected to the session cluster already: the dry run uses that connection
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.get_runtime_context().gcs_address)
    # the demo config otherwise; this corpus is too small for the demo's validation split
    args = [f"data.data_path=[{corpus}]", "training.eval_iters=0", "--dry-run"]
    assert pretrain.main([f"output.dir={tmp_path / 'ok'}", *args]) == 0
    report = json.loads(capsys.readouterr().out)["preflight"]
    assert report["ok"] and len(report["nodes"]) == 1

    assert pretrain.main([f"output.dir={tmp_path / 'ok'}", f"checkpoint.load={tmp_path / 'none'}",
                          *args]) == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)["preflight"]
    assert not report["ok"] and f"checkpoint.load {tmp_path / 'none'}: missing" in captured.err


def test_a_node_that_does_not_answer_in_time_is_named(ray_cluster, corpus, tmp_path):
    # (last here: the unanswered check's worker is killed, the others reuse theirs)
    cfg = config(corpus, tmp_path, "cluster.placement_timeout_s=0.001")
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"\S+/[0-9a-f]{8}: no answer within 0\.001 s "
                                           r"\(cluster\.placement_timeout_s\)"):
        preflight.check(cfg)
    assert time.monotonic() - start < 5


def test_workers_without_cpus_beside_their_ppus_are_refused_at_once(ray_cluster, corpus,
                                                                    tmp_path):
    """4 workers × 3 CPU on the test cluster's one node of 8 CPU (the reader's 0.5 of
    them) and more PPUs: the group could never be placed, so the launch says so before it
    waits."""
    from ray_ppu.launch.preflight import check_capacity

    cfg = config(corpus, tmp_path, "cluster.num_workers=4", "cluster.cpus_per_worker=3")
    with pytest.raises(ClusterError, match=rf"4 workers × 3 CPU .* hold 2: .*{SIMULATED_PPUS} PPU, "
                                           r"8 CPU of which the readers take 0.5: room for 2 worker"):
        check_capacity(cfg)
    check_capacity(config(corpus, tmp_path, "cluster.num_workers=4", "cluster.cpus_per_worker=1"))
