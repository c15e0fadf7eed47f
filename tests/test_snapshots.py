"""In-memory snapshots: which snapshot a restarted group takes (ray_ppu.recovery.snapshot_keeper), the
keepers as real Ray actors, and a snapshot taken and restored on a real Megatron-Core model and
distributed optimizer (ray_ppu.recovery.snapshot). The end-to-end restore after a killed worker is
test_checkpoint.py::test_killed_worker_restores_from_memory."""

import pytest

from ray_ppu.recovery import snapshot_keeper as keeper

LAYOUT = (2, 1, 1, 1, 2, 1, 1, 1)  # world 2, DP 2 (ray_ppu.recovery.snapshot.layout_of)
SHRUNK = (1, 1, 1, 1, 1, 1, 1, 1)  # the same model shards at DP 1


def _entry(layout=LAYOUT, rank=0, reshardable=True):
    """A keeper's index entry for a snapshot of ``rank`` (its DP rank: TP 1) in ``layout``."""
    return {"layout": layout, "coords": (0, 0, 0, rank, 0, 0), "reshardable": reshardable}


def _found(found):
    return found and (found.iteration, found.layout, found.holders)


def test_the_newest_snapshot_every_rank_has_is_chosen():
    # node a holds rank 0's snapshots, node b rank 1's and (as a's replica) rank 0's of 7
    indexes = {"a": {0: {6: _entry(), 7: _entry()}},
               "b": {1: {5: _entry(rank=1), 6: _entry(rank=1)}, 0: {7: _entry()}}}
    assert _found(keeper.newest_restorable(indexes, LAYOUT)) == (6, LAYOUT, {0: ["a"], 1: ["b"]})
    # rank 1's copy of 7 arrives: 7 is complete, rank 0's from either node
    indexes["b"][1][7] = _entry(rank=1)
    found = keeper.newest_restorable(indexes, LAYOUT)
    assert _found(found) == (7, LAYOUT, {0: ["a", "b"], 1: ["b"]})
    assert found.coords == {0: (0, 0, 0, 0, 0, 0), 1: (0, 0, 0, 1, 0, 0)}


def test_no_snapshot_of_other_model_shards_or_older_than_the_disk_checkpoint():
    other = (2, 2, 1, 1, 1, 1, 1, 1)  # TP 2: other model shards, never resharded
    indexes = {"a": {0: {6: _entry(other)}, 1: {6: _entry(other, 1)}}}
    assert keeper.newest_restorable(indexes, LAYOUT) is None
    indexes = {"a": {0: {6: _entry()}, 1: {6: _entry(rank=1)}}}
    assert keeper.newest_restorable(indexes, LAYOUT, not_before=7) is None
    assert keeper.newest_restorable(indexes, LAYOUT, not_before=6).iteration == 6
    # a rank whose copies are all lost (its node and its replica's node): none complete
    assert keeper.newest_restorable({"a": {0: {6: _entry()}}}, LAYOUT) is None


def test_a_resized_group_reshards_the_newest_complete_snapshots():
    # the DP 2 group's snapshots of 7 restore a DP 1 group (shrunk after a node loss) ...
    indexes = {"a": {0: {6: _entry(), 7: _entry()}, 1: {6: _entry(rank=1), 7: _entry(rank=1)}}}
    found = keeper.newest_restorable(indexes, SHRUNK)
    assert _found(found) == (7, LAYOUT, {0: ["a"], 1: ["a"]}) and found.coords[1][3] == 1
    # ... unless one of them does not reshard (host-offloaded optimizer state)
    indexes["a"][1][7] = _entry(rank=1, reshardable=False)
    assert keeper.newest_restorable(indexes, SHRUNK).iteration == 6
    # at one iteration the group's own layout wins; a newer resharded one beats an older own
    indexes["b"] = {0: {7: _entry(SHRUNK)}}
    assert _found(keeper.newest_restorable(indexes, SHRUNK)) == (7, SHRUNK, {0: ["b"]})
    indexes["a"][1][7] = _entry(rank=1)
    indexes["a"][0][8], indexes["a"][1][8] = _entry(), _entry(rank=1)
    assert keeper.newest_restorable(indexes, SHRUNK).layout == LAYOUT


def test_replicas_go_round_a_ring_of_nodes():
    assert keeper.replica_of("b", ["c", "a", "b"]) == "c"
    assert keeper.replica_of("c", ["c", "a", "b"]) == "a"
    assert keeper.replica_of("a", ["a"]) is None  # one node: the copy stays there


def test_keeper_holds_the_newest_two_per_rank_and_imports_no_torch(ray_cluster):
    import ray

    node = ray.get_runtime_context().get_node_id()
    (handle,) = keeper.start("test-keeper", [node])
    try:
        for iteration in (1, 2, 3):
            ray.get(handle.put.remote(0, iteration, LAYOUT, ((0, 0, 0, 0, 0, 0), True), 3,
                                      b"ab" + bytes([iteration])))
        assert ray.get(handle.index.remote()) == {0: {2: _entry(), 3: _entry()}}
        assert ray.get(handle.get.remote(0, 3)) == b"ab\x03"
        with pytest.raises(ray.exceptions.RayTaskError, match="2 bytes arrived of 5"):
            ray.get(handle.put.remote(1, 3, LAYOUT, ((0, 0, 0, 1, 0, 0), True), 5,
                                      b"ab"))  # never held
        assert 1 not in ray.get(handle.index.remote())
        assert keeper.keepers("test-keeper", [node, "gone"]) == {node: handle}
        modules = ray.get(handle.modules.remote())
        assert "ray" in modules and "torch" not in modules and "megatron" not in modules
    finally:
        ray.kill(handle)


def _step(model, optimizer, scheduler, seed):
    """One optimizer step on random gradients (what a training step leaves behind)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for chunk in model:
        for param in chunk.parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=generator))
    optimizer.step()
    scheduler.step(increment=8)


def _flat(state) -> list:
    """Every tensor and number of a captured state, in order."""
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [x for k in sorted(state, key=str) for x in _flat(state[k])]
    if isinstance(state, (list, tuple)):
        return [x for v in state for x in _flat(v)]
    return [state]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_snapshot_restores_the_whole_training_state(precision):
    """Model weights, the distributed optimizer's fp32 main parameters and Adam state, the
    schedule and the RNG, captured after a step and restored after another step changed all
    of them: the restored state is the captured one, value for value — loaded as it is (the
    same layout) and assembled range by range from the old group's pieces (the resharding
    path an elastically resized group takes; here the old group is this one rank)."""
    import random

    import torch

    from ray_ppu.recovery import snapshot
    from ray_ppu.model.optim import build_optimizer
    from test_options import built

    with built(f"training.precision={precision}") as (cfg, plan, model, optimizer):
        optimizer, scheduler = build_optimizer(cfg, plan, model)
        _step(model, optimizer, scheduler, seed=1)
        taken = snapshot.capture(1, model, optimizer, scheduler, with_cuda=False)
        assert taken["reshardable"] and taken["coords"] == (0, 0, 0, 0, 0, 0)
        blob = snapshot.serialize(taken)
        for sources in (None, {0: taken["coords"]}):
            _step(model, optimizer, scheduler, seed=2)
            random.random(), torch.rand(3)  # the RNG moves on too
            moved = _flat(snapshot.capture(2, model, optimizer, scheduler, False)["model"])
            assert not all(torch.equal(a, b) for a, b in zip(_flat(taken["model"]), moved)
                           if isinstance(a, torch.Tensor))
            point = snapshot.MemoryPoint(1, ("node",), lambda rank: blob, sources=sources)
            assert snapshot.restore(point, model, optimizer, scheduler) == 1
            _assert_same_state(taken, snapshot.capture(1, model, optimizer, scheduler, False))


def _assert_same_state(want_state: dict, got_state: dict) -> None:
    import numpy as np
    import torch

    for want, got in zip(_flat(want_state), _flat(got_state), strict=True):
        if isinstance(want, torch.Tensor):
            assert want.dtype == got.dtype and torch.equal(want, got)
        elif isinstance(want, np.ndarray):  # NumPy's RNG state
            assert np.array_equal(want, got)
        elif not isinstance(want, float) or want == want:  # NaN-free numbers compare
            assert want == got


def test_pieces_assemble_the_range_a_rank_needs():
    """Old DP ranks' pieces of one flattened parameter tile it: a new rank's range across
    their boundaries comes out whole, and a gap (a piece lost) is an error naming it."""
    import torch

    from ray_ppu.checkpoint import CheckpointError
    from ray_ppu.recovery.snapshot_reshard import assemble

    full = torch.arange(10.0)
    pieces = [(5, 10, full[5:10]), (0, 3, full[0:3]), (3, 5, full[3:5])]
    assert torch.equal(assemble(pieces, 2, 8, "w"), full[2:8])
    assert torch.equal(assemble(pieces, 0, 10, "w"), full)
    assert torch.equal(assemble(pieces[:1], 6, 9, "w"), full[6:9])
    with pytest.raises(CheckpointError, match="elements of w up to 3 of the 2..8"):
        assemble([pieces[1], pieces[0]], 2, 8, "w")


def test_snapshots_need_the_host_memory_the_plan_says(caplog):
    """The memory plan prices a device's snapshot (7B preset, TP 2 × DP 8, bf16: weights and
    the DP shard of main parameters and Adam) and the launch turns snapshots off, saying so,
    on a node that lacks five times that per PPU."""
    from ray_ppu.config.loader import load
    from ray_ppu.launch.launcher import _snapshots_fit
    from ray_ppu.plan.memory import GIB, memory_plan
    from ray_ppu.plan import build_plan

    cfg = load(None, ["model.preset=7B", "cluster.num_workers=16", "training.train_iters=10",
                      "parallel.tensor_model_parallel_size=2", "training.precision=bf16",
                      "training.global_batch_size=64", "data.data_path=[x]"])
    plan = build_plan(cfg)
    mem = memory_plan(cfg, plan)
    params = mem.parameters_gib * GIB / 2  # bf16 weights: 2 bytes each
    assert mem.snapshot_gib == pytest.approx((params * 2 + params * 12 / 8) / GIB)
    assert mem.snapshot_host_gib == pytest.approx(5 * mem.snapshot_gib)
    node = {"NodeID": "n1", "NodeManagerAddress": "10.0.0.1", "Resources": {"PPU": 16}}
    need = 16 * mem.snapshot_host_gib

    def checked(available):
        return {"nodes": [{"node_id": "n1", "host_available_gib": available}]}

    assert _snapshots_fit(cfg, plan, checked(2 * need), [node])
    assert not _snapshots_fit(cfg, plan, checked(need), [node])
    assert f"10.0.0.1/n1 needs {need:.1f} GiB, has {need:.1f} available" in caplog.text
