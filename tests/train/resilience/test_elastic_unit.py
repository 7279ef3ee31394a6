"""The elastic supervisor's pure parts: the batch arithmetic and the argv it relaunches with."""

import pytest

from loongforge.shared.errors import ConfigError
from loongforge.train.resilience.elastic.supervisor import accum_for, strip_flags


def test_accum_keeps_the_global_batch_and_bounds_the_micro_batch():
    assert accum_for(8, 2, max_micro=4) == 1  # the full layout: micro 4
    assert accum_for(8, 1, max_micro=4) == 2  # one rank left: micro 4, accumulated twice
    assert accum_for(12, 3, max_micro=2) == 2
    with pytest.raises(ConfigError, match="cannot be split over 3 ranks"):
        accum_for(8, 3, max_micro=4)


def test_strip_flags_removes_what_the_supervisor_sets_and_keeps_the_rest():
    argv = ["--elastic", "--min-ranks", "1", "--max-ranks=2", "--data", "D", "--grad-accum", "2", "--resume",
            "--capacity-file", "F", "--steps", "9"]
    assert strip_flags(argv) == ["--data", "D", "--steps", "9"]


def test_which_layout_changes_the_supervisor_converts_before_a_relaunch():
    from loongforge.train.resilience.elastic.supervisor import tag_step
    from loongforge.train.resilience.elastic.reshard import needs_conversion

    z2 = {"world": 2, "zero_stage": 2}
    assert needs_conversion(z2, world=1, zero=2, tp=1, sp=1)  # ZeRO-1/2: partitioned Adam state
    assert not needs_conversion(z2, world=2, zero=2, tp=1, sp=1)  # same layout
    assert not needs_conversion({"world": 2, "zero_stage": 0}, world=1, zero=0, tp=1, sp=1)  # replicated
    assert not needs_conversion({"world": 2, "zero_stage": 3}, world=1, zero=3, tp=1, sp=1)  # trainer: universal
    assert needs_conversion({"world": 2, "zero_stage": 3}, world=1, zero=3, tp=1, sp=1, topk=True)  # hybrid
    assert tag_step("step00000004") == 4 and tag_step("step00000004_w1z2t1") == 4


def test_a_failed_conversion_warns_and_leaves_latest_on_the_original(tmp_path, caplog):
    """The converter's child fails on a checkpoint that verifies but is no DeepSpeed checkpoint: one WARNING,
    `latest` untouched, no new tag or work directory left, and the record says why."""
    import json
    import logging
    import os

    from loongforge.train.ckpt.files import SIDECAR
    from loongforge.train.ckpt.reshard_io import publish
    from loongforge.train.resilience.elastic.reshard import convert_for_launch

    root = tmp_path / "run" / "checkpoints"
    out = root / ".staging"
    out.mkdir(parents=True)
    (out / "mp_rank_00_model_states.pt").write_bytes(b"not a torch file")
    publish(str(root), str(out), "step00000004", {"format": "loongforge-checkpoint", "format_version": 2,
                                                  "step": 4, "world": 2, "zero_stage": 2, "loader": {}})
    before = sorted(os.listdir(root))
    with caplog.at_level(logging.WARNING, logger="loongforge.train.resilience.elastic.reshard"):
        rec = convert_for_launch(str(tmp_path / "run"), world=1, zero=2, timeout_s=300)
    assert rec["action"] == "reshard" and rec["ok"] is False and rec["from_tag"] == "step00000004", rec
    assert (root / "latest").read_text() == "step00000004" and sorted(os.listdir(root)) == before
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warn and "failed, resuming it as it is" in warn[0] and rec["error"][:40] in warn[0]
    assert json.loads((root / "step00000004" / SIDECAR).read_text())["world"] == 2


def test_the_restart_budget_replenishes_over_its_window():
    from loongforge.train.resilience.elastic.budget import RestartBudget

    now = [0.0]
    budget = RestartBudget(3, 3600, clock=lambda: now[0])
    for t in (0, 10, 20):
        now[0] = t
        assert budget.spend()
    now[0] = 30
    assert not budget.spend() and budget.describe() == "restart 3 of 3 within 3600 s"  # a crash loop ends
    now[0] = 3600  # the first fault is an hour old: it no longer counts
    assert budget.spend() and budget.in_window() == 3
    lifetime = RestartBudget(1, 0, clock=lambda: now[0])  # --restart-window 0: torchelastic's lifetime count
    assert lifetime.spend()
    now[0] = 1e9
    assert not lifetime.spend()


def _supervisor(tmp_path, **kw):
    import types

    from loongforge.train.resilience.elastic.supervisor import Supervisor

    args = dict(batch_plan=None, min_ranks=1, max_ranks=2, tp=1, sp=1, zero=2, batch_size=8, grad_accum=1,
                grad_compression="none", capacity_file=None, max_restarts=3, restart_window=3600.0,
                run_dir=str(tmp_path / "run"), steps=4, resume=False, overwrite=False, term_grace_s=60.0, nodes=1,
                nproc_per_node=None, node_id="n0", node_addr=None, rdzv_timeout_s=5.0)
    args.update(kw)
    return Supervisor(types.SimpleNamespace(**args), [])


def _fake_faults(monkeypatch, sup, faults: int, spacing_s: float):
    """Every launch of `sup` fails (rank 1 SIGKILLed) `faults` times, `spacing_s` apart, then finishes."""
    from loongforge.train.resilience.elastic import leader

    now, calls = [0.0], []
    sup.budget.clock = lambda: now[0]
    monkeypatch.setattr(leader, "convert_for_launch", lambda *a, **k: None)

    def launch(plan, watch):
        calls.append(plan["world"])
        now[0] += spacing_s
        if len(calls) <= faults:
            return 1, {"rc": 1, "node": "n0", "failures": [
                {"rank": 1, "local_rank": 1, "pid": 7, "exitcode": -9, "signal": "SIGKILL", "t": 0},
                {"rank": 0, "local_rank": 0, "pid": 6, "exitcode": 75, "signal": None, "t": 0}]}
        return 0, {"rc": 0, "node": "n0", "failures": []}

    monkeypatch.setattr(sup, "launch", launch)
    return calls


def test_a_fourth_fault_an_hour_after_the_first_is_relaunched_not_fatal(tmp_path, monkeypatch, capsys):
    """--max-restarts 3 within --restart-window 3600: four faults 20 minutes apart never have more than 3 in
    an hour, so the run goes on (the old budget counted faults over the run's life: the 4th ended it)."""
    from loongforge.shared.errors import TrainError
    from loongforge.train.resilience.elastic.leader import Leader

    sup = _supervisor(tmp_path)
    calls = _fake_faults(monkeypatch, sup, faults=4, spacing_s=1200)
    try:
        assert Leader(sup).run() == 0
    finally:
        sup.close()
    assert len(calls) == 5
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("loongforge train: fault")]
    assert len(lines) == 4 and "rank 1 on node n0 (pid 7) killed by SIGKILL; 1 other rank(s) stopped" in lines[0]
    assert lines[-1].endswith("relaunching (restart 3 of 3 within 3600 s)"), lines  # the first one has expired

    sup = _supervisor(tmp_path, run_dir=str(tmp_path / "fast"))
    _fake_faults(monkeypatch, sup, faults=4, spacing_s=60)  # a crash loop: 4 faults in 4 minutes
    try:
        with pytest.raises(TrainError, match=r"restart budget is spent \(3 restarts within 3600 s"):
            Leader(sup).run()
    finally:
        sup.close()


def test_ranks_are_split_over_nodes_leader_first_within_max_and_tp():
    from loongforge.train.resilience.elastic.nodes import split_ranks

    assert split_ranks([("a", 2), ("b", 2)], max_ranks=4, group=1) == [("a", 2), ("b", 2)]
    assert split_ranks([("a", 2), ("b", 2)], max_ranks=3, group=1) == [("a", 2), ("b", 1)]
    assert split_ranks([("a", 1), ("b", 2)], max_ranks=4, group=2) == [("a", 1), ("b", 1)]  # 3 -> a multiple of 2
    assert split_ranks([("a", 0), ("b", 1)], max_ranks=4, group=1) == [("b", 1)]


def test_the_fault_is_named_by_its_cause_never_by_a_collateral_rank():
    from loongforge.train.resilience.elastic.blame import name_fault

    plan = {"nodes": [{"id": "a", "nproc": 1}, {"id": "b", "nproc": 1}]}
    collateral = {"rank": 0, "local_rank": 0, "pid": 5, "exitcode": 75, "signal": None}
    killed = {"rank": 1, "local_rank": 0, "pid": 6, "exitcode": -9, "signal": "SIGKILL"}
    a = {"rc": 1, "failures": [collateral]}
    f = name_fault(plan, {"a": a, "b": None}, ["b"], [])
    assert (f.kind, f.node, f.collateral) == ("node_lost", "b", 1) and "node b lost (1 rank(s))" in f.why
    f = name_fault(plan, {"a": a, "b": {"rc": 1, "failures": [killed]}}, [], [])
    assert (f.kind, f.rank, f.node) == ("signal", 1, "b") and "rank 1 on node b (pid 6) killed by SIGKILL" in f.why
    stopped = {"kind": "dead", "rank": 1, "node": "b", "why": "no heartbeat for 5.0s; pid 6 is stopped (SIGSTOP)",
               "detected_by": 0}
    f = name_fault(plan, {"a": a, "b": {"rc": 1, "failures": [killed]}}, [], [stopped])
    assert (f.kind, f.rank, f.drop) == ("dead", 1, {"b": 1}) and "SIGSTOP" in f.why  # the watchdog's cause
    own = {"rank": 1, "local_rank": 0, "pid": 6, "exitcode": 1, "signal": None}
    f = name_fault(plan, {"a": a, "b": {"rc": 1, "failures": [own]}}, [], [])
    assert f.kind == "exit" and "exited with code 1" in f.why
    f = name_fault(plan, {"a": {"rc": 3, "failures": [], "error": "rendezvous: RendezvousTimeoutError: x"},
                          "b": None}, [], [])
    assert f.kind == "rendezvous" and f.node == "a"


def test_torchrun_options_the_supervisor_sets_itself_are_refused(tmp_path, monkeypatch):
    """--nnodes & co. behind the supervisor's back made it convert the checkpoint for its own rank count while
    the launch ran another world, then wait in a rendezvous that could not complete."""
    from loongforge.shared.errors import UsageError

    monkeypatch.setenv("LOONGFORGE_TORCHRUN_ARGS", "--nnodes 2 --node_rank 1 --master_addr h --master_port 29500")
    with pytest.raises(UsageError, match="--nodes, --nproc-per-node and --node-addr on every node"):
        _supervisor(tmp_path)


def test_a_rank_whose_world_is_not_the_planned_one_refuses_before_loading(monkeypatch):
    from loongforge.shared.errors import UsageError
    from loongforge.train.launch import _check_planned_world

    monkeypatch.setenv("LOONGFORGE_PLANNED_WORLD", "2")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(UsageError, match="this launch has 1 ranks but the elastic supervisor planned 2"):
        _check_planned_world()
    monkeypatch.setenv("WORLD_SIZE", "2")
    _check_planned_world()


def test_the_exit_barrier_ends_when_a_node_of_the_attempt_is_gone(tmp_path):
    """torchrun's exit barrier waited its full 300 s for an agent that had died (a follower killed with its
    process group), holding the leader silent. Ours (agent.py), on a real TCPStore and the nodes' real
    locks: it waits while node b lives, returns within a poll once b's supervisor is gone, and returns at
    once when every node checks in."""
    import threading
    import time
    import types

    from torch.distributed import PrefixStore, TCPStore

    from loongforge.train.resilience.elastic.agent import exit_barrier_while_nodes_live
    from loongforge.train.resilience.elastic.nodes import Board

    run_dir = str(tmp_path / "run")
    b = Board(run_dir, "b")
    b.join({"pid": 1})
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    barrier = exit_barrier_while_nodes_live(run_dir, ["b"])

    def agent(prefix: str):
        return types.SimpleNamespace(_store=PrefixStore(prefix, store),
                                     _worker_group=types.SimpleNamespace(group_world_size=2), _exit_barrier_timeout=60)

    waiting = threading.Thread(target=barrier, args=(agent("attempt0"),), daemon=True)
    waiting.start()
    waiting.join(1.5)
    assert waiting.is_alive()  # b lives and has not checked in: wait
    t0 = time.monotonic()
    b.leave()  # b's supervisor is gone
    waiting.join(10)
    assert not waiting.is_alive() and time.monotonic() - t0 < 5
    b.join({"pid": 1})  # b is back: only checking in ends the barrier now
    both = [threading.Thread(target=barrier, args=(agent("attempt1"),)) for _ in range(2)]
    t0 = time.monotonic()
    for t in both:
        t.start()
    for t in both:
        t.join(10)
    assert not any(t.is_alive() for t in both) and time.monotonic() - t0 < 5
    b.leave()
