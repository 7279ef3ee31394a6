"""Elastic training across nodes, on one machine: two supervisors (`--nodes 2 --node-id a|b`, one rank
each, separate local dirs) on one run dir, torchrun's c10d rendezvous hosted by the leader's launcher.
A node is killed outright (every process of it, SIGKILL: the machine dies); the other node relaunches
alone from the last checkpoint, and (the `full` test) the killed node comes back and is taken in at the
next checkpoint, the final state equal to an uninterrupted 2-rank run's."""

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.train.ckpt.test_ckpt_resilience import COMMON, _kill_tree, _metrics  # noqa: E402
from tests.train.resilience.test_faults import _global_order  # noqa: E402
from tests.train.train_launch import VENV_BIN, launch_env  # noqa: E402

pytestmark = pytest.mark.slow


class Node:
    """One node's supervisor: `loongforge train --elastic --nodes 2 --node-id ID` with its own TMPDIR and
    torch extensions dir (what is local to a node); the run dir is shared."""

    def __init__(self, node_id: str, work, run_dir: str, args: list[str]):
        local = work / f"node-{node_id}"
        local.mkdir(exist_ok=True)
        env = launch_env(dict(os.environ, TMPDIR=str(local), TORCH_EXTENSIONS_DIR=str(local / "ext")))
        self.err_path = work / f"node-{node_id}.err"
        cmd = [str(VENV_BIN / "loongforge"), "train", "--elastic", "--nodes", "2", "--nproc-per-node", "1",
               "--node-id", node_id, "--node-addr", "127.0.0.1", "--min-ranks", "1", "--max-ranks", "2",
               "--rdzv-timeout-s", "120", "--run-dir", run_dir, *args]
        self.proc = subprocess.Popen(cmd, cwd=str(local), env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(self.err_path, "a"), start_new_session=True)

    def err(self) -> str:
        return self.err_path.read_text()

    def kill(self) -> None:
        """The node dies: its supervisor, launcher, rank and decode workers at once."""
        _kill_tree(self.proc.pid)
        self.proc.wait()


def _events(run_dir, kind, action=None):
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(ln) for ln in open(path)] if os.path.exists(path) else []
    return [r for r in rows if r.get("event") == kind and (action is None or r.get("action") == action)]


def _wait(pred, nodes, timeout=400):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if any(n.proc.poll() is not None for n in nodes):
            break
        time.sleep(0.2)
    raise AssertionError("not reached: " + " | ".join(n.err()[-2000:] for n in nodes))


def _leading(node: Node, run_dir: str) -> Node:
    """Wait until `node` holds the run lock (leads), then return it."""
    from loongforge.train.resilience.runlock import holder

    _wait(lambda: holder(run_dir).get("pid") == node.proc.pid, [node], timeout=120)
    return node


def _steps(run_dir):
    return [r for r in _metrics(run_dir) if "event" not in r]


def test_a_node_lost_the_other_goes_on_alone_from_the_last_checkpoint(train_root, tmp_path):
    """ZeRO-0 (the `full` test converts ZeRO-2): node b dies after step 5; node a's launch ends (its rank's
    collective fails: exit 75, the traceback in the node log), a names the lost node in one line and a fault
    record, and relaunches alone (grad accum 2, same global batch) from the last checkpoint, which it names
    in the plan and the rank loads. Every step's samples are its slice of the global order."""
    root, index = train_root
    run_dir = str(tmp_path / "run")
    steps = 20  # the kill lands after step 5: 15 steps of margin however fast the machine
    args = ["--data", root, "--steps", str(steps), "--save-every", "2", "--zero", "0", *COMMON]
    a = _leading(Node("a", tmp_path, run_dir, args), run_dir)
    b = Node("b", tmp_path, run_dir, args)
    try:
        _wait(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(_steps(run_dir)) >= 5, [a, b])
        b.kill()
        rc = a.proc.wait(timeout=400)
    finally:
        for n in (a, b):
            if n.proc.poll() is None:
                _kill_tree(n.proc.pid)
    err = a.err()
    assert rc == 0, err[-4000:]
    launches = _events(run_dir, "elastic", "launch")
    assert [(e["ranks"], e["grad_accum"], e["nodes"]) for e in launches] == [(2, 1, {"a": 1, "b": 1}),
                                                                              (1, 2, {"a": 1})], launches
    # The supervisor's record; on a loaded machine rank 0's watchdog may see the dead peer first (no
    # heartbeat for 10 s) and record it too: the same node, never another fault.
    faults = _events(run_dir, "fault")
    (fault,) = [f for f in faults if f["kind"] == "node_lost"]
    assert (fault["node"], fault["detected_by"]) == ("b", "supervisor"), fault
    assert all(f["kind"] == "dead" and f["node"] == "b" and f["rank"] == 1 for f in faults if f is not fault), faults
    lines = [ln for ln in err.splitlines() if ln.startswith("loongforge train: fault")]
    assert len(lines) == 1 and "node b lost" in lines[0] and "its supervisor is gone" in lines[0], err[-4000:]
    for noise in ("Traceback", "ChildFailedError", "remote worker hanging", "Terminated"):
        assert noise not in err, (noise, err[-4000:])
    resumed = launches[1]["latest"]
    assert resumed and f"resumed from {resumed} at step {int(resumed[4:12])}" in err, err[-4000:]
    # After the fault line, the relaunch says what it does (launching, the thread count, resumed from, the
    # attention kernel) and trains: the plan table, the model line, the tracker lines, `--resume: no checkpoint`
    # and DeepSpeed's FutureWarnings were ~18 lines of it.
    after = err.split("loongforge train: fault", 1)[1].splitlines()[1:]
    start = after[:next(i for i, ln in enumerate(after) if ln.startswith("step "))]
    assert len(start) <= 4, start
    for noise in ("FutureWarning", "parallel plan", "--resume: no checkpoint", "TensorBoard:", "model tiny"):
        assert noise not in "\n".join(start), (noise, start)
    got = _steps(run_dir)
    assert [r["step"] for r in got] == list(range(steps))
    assert got[0]["world"] == 2 and got[-1]["world"] == 1
    seen = [sorted(i for ids in r["sample_ids"] for i in ids) for r in got]
    assert seen == _global_order(index, steps, 8)


def _weights(run_dir: str, tag: str) -> dict:
    """{name: fp32 tensor} of a checkpoint, gathered to one rank by `ckpt reshard` (layout-free)."""
    import torch

    from loongforge.train.ckpt.files import weights_only_loads
    from loongforge.train.ckpt.reshard import Layout, reshard

    new = reshard(run_dir, Layout(world=1, zero=0), tag=tag, move_latest=False)
    with weights_only_loads():
        doc = torch.load(os.path.join(run_dir, "checkpoints", new, "mp_rank_00_model_states.pt"), weights_only=True)
    return {k: v.float() for k, v in doc["module"].items()}


# make test covers the loss of a node (the test above); this one adds its return, two conversions and the
# comparison with an uninterrupted run (three launches more, ~3 min on 2 cores).
@pytest.mark.full
def test_a_node_lost_and_returned_ends_where_the_uninterrupted_run_ends(train_root, tmp_path):
    """ZeRO-2, 2 nodes x 1 rank: the leading node a dies after step 5; b takes the lead (the run lock), names
    the lost node and goes on alone from step 4 (converted to 1 rank, Adam moments kept); a comes back with
    the same command, follows, and is taken in at the next checkpoint (converted to 2 ranks). The 16 steps'
    losses and the final weights equal an uninterrupted 2-rank run's (1e-4: the 1-rank stretch sums its
    gradients in another order), and every step's samples are its slice of the global order."""
    from tests.train.ckpt.test_ckpt_resilience import _ok
    from tests.train.train_launch import torchrun

    root, index = train_root
    steps = 16
    args = ["--data", root, "--steps", str(steps), "--save-every", "4", "--zero", "2", *COMMON]
    ref = str(tmp_path / "ref")
    _ok(torchrun(2, ["--run-dir", ref, *args], cwd=str(tmp_path), timeout=600))
    run_dir = str(tmp_path / "run")
    a = _leading(Node("a", tmp_path, run_dir, args), run_dir)
    b = Node("b", tmp_path, run_dir, args)
    try:
        _wait(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(_steps(run_dir)) >= 5, [a, b])
        a.kill()
        _wait(lambda: len(_events(run_dir, "elastic", "launch")) == 2, [b])  # b alone
        a = Node("a", tmp_path, run_dir, args)  # the node comes back: the same command
        rc_b = b.proc.wait(timeout=900)
        rc = a.proc.wait(timeout=120)
    finally:
        for n in (a, b):
            if n.proc.poll() is None:
                _kill_tree(n.proc.pid)
    assert (rc, rc_b) == (0, 0), b.err()[-4000:] + a.err()[-3000:]
    launches = [(e["ranks"], e["nodes"]) for e in _events(run_dir, "elastic", "launch")]
    assert launches == [(2, {"a": 1, "b": 1}), (1, {"b": 1}), (2, {"b": 1, "a": 1})], launches
    (fault,) = _events(run_dir, "fault")
    assert (fault["kind"], fault["node"]) == ("node_lost", "a"), fault
    err = b.err()
    assert "node b leads the run now" in err and "loongforge train: fault in attempt 0: node a lost" in err, err[-3000:]
    conv = [(c["from_world"], c["to"].split(",")[0], c["ok"]) for c in _events(run_dir, "elastic", "reshard")]
    assert conv == [(2, "world=1", True), (1, "world=2", True)], conv
    got, want = _steps(run_dir), _metrics(ref)
    assert [r["step"] for r in got] == list(range(steps))
    assert [sorted(i for ids in r["sample_ids"] for i in ids) for r in got] == _global_order(index, steps, 8)
    for x, y in zip(want, got, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-4), (y["step"], x["loss"], y["loss"])
    mine, theirs = _weights(run_dir, f"step{steps:08d}"), _weights(ref, f"step{steps:08d}")
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert (mine[k] - theirs[k]).abs().max() <= 1e-4 * max(1.0, theirs[k].abs().max()), k


# make test covers a node that dies (the first test); this is one that is asked to leave (~1 min).
@pytest.mark.full
def test_a_follower_preempted_leaves_and_the_run_goes_on_without_a_fault(train_root, tmp_path):
    """SIGTERM to node b's supervisor (its node preempted): every rank finishes the step and a checkpoint is
    written; b exits 85 with one line saying the others go on; a relaunches alone from that checkpoint with
    no fault record and no restart spent, and finishes."""
    root, index = train_root
    run_dir = str(tmp_path / "run")
    steps = 20
    args = ["--data", root, "--steps", str(steps), "--save-every", "50", "--zero", "0", *COMMON]
    a = _leading(Node("a", tmp_path, run_dir, args), run_dir)
    b = Node("b", tmp_path, run_dir, args)
    try:
        _wait(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(_steps(run_dir)) >= 5, [a, b])
        b.proc.send_signal(15)
        rc_b = b.proc.wait(timeout=200)
        rc = a.proc.wait(timeout=400)
    finally:
        for n in (a, b):
            if n.proc.poll() is None:
                _kill_tree(n.proc.pid)
    assert (rc, rc_b) == (0, 85), a.err()[-3000:] + b.err()[-3000:]
    (line,) = [ln for ln in b.err().splitlines() if ln.startswith("loongforge train:")]
    assert "node b left the run on SIGTERM (stopped by SIGTERM after step" in line and "the other nodes go on" in line
    assert not _events(run_dir, "fault") and "loongforge train: fault" not in a.err()
    (left,) = _events(run_dir, "elastic", "node_left")
    launches = _events(run_dir, "elastic", "launch")
    assert left["nodes"] == ["b"] and [e["nodes"] for e in launches] == [{"a": 1, "b": 1}, {"a": 1}]
    stopped_at = int(launches[1]["latest"][4:12])
    got = _steps(run_dir)
    assert [r["step"] for r in got] == list(range(steps)) and got[stopped_at]["world"] == 1
    assert [sorted(i for ids in r["sample_ids"] for i in ids) for r in got] == _global_order(index, steps, 8)


# make test covers a node that dies whole (the first test); here only its supervisor's process group is
# killed, the way a scheduler or a shell ends a job (~1.5 min).
@pytest.mark.full
def test_a_follower_killed_by_its_process_group_is_a_lost_node_noticed_in_seconds(train_root, tmp_path):
    """`kill -9 -PGID` of node b: only b's supervisor dies (its torchrun agent runs in a session of its own
    and gets SIGTERM from its dying parent; b's rank finishes its step and writes a checkpoint). The leader
    printed nothing for 300 s (its agent in torchrun's exit barrier, waiting for b's agent, which was gone),
    then called b `left`, with no fault record. Now the exit barrier ends once a planned node is gone, and a
    node whose supervisor is gone without saying it leaves is lost: one fault line within seconds, a fault
    record, a relaunch alone from the checkpoint, and the run finishes."""
    import signal as sig

    root, index = train_root
    run_dir = str(tmp_path / "run")
    steps = 20
    args = ["--data", root, "--steps", str(steps), "--save-every", "50", "--zero", "0", *COMMON]
    a = _leading(Node("a", tmp_path, run_dir, args), run_dir)
    b = Node("b", tmp_path, run_dir, args)
    try:
        _wait(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(_steps(run_dir)) >= 5, [a, b])
        os.killpg(b.proc.pid, sig.SIGKILL)  # the supervisor leads its own process group (start_new_session)
        killed = time.monotonic()
        _wait(lambda: "loongforge train: fault" in a.err(), [a], timeout=120)
        noticed = time.monotonic() - killed
        rc = a.proc.wait(timeout=400)
    finally:
        for n in (a, b):
            if n.proc.poll() is None:
                _kill_tree(n.proc.pid)
        for pid in _pids_of(run_dir):  # b's agent and rank, outside its process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig.SIGKILL)
    err = a.err()
    assert rc == 0, err[-4000:]
    assert noticed < 90, (noticed, err[-3000:])  # 300 s and more before; the step and its checkpoint take seconds
    (fault,) = _events(run_dir, "fault")
    assert (fault["kind"], fault["node"]) == ("node_lost", "b"), fault
    lines = [ln for ln in err.splitlines() if ln.startswith("loongforge train:")]
    assert len(lines) == 1 and "node b lost" in lines[0], err[-4000:]
    assert not _events(run_dir, "elastic", "node_left") and "left the run" not in err
    launches = _events(run_dir, "elastic", "launch")
    assert [e["nodes"] for e in launches] == [{"a": 1, "b": 1}, {"a": 1}], launches
    got = _steps(run_dir)
    assert [r["step"] for r in got] == list(range(steps))
    assert [sorted(i for ids in r["sample_ids"] for i in ids) for r in got] == _global_order(index, steps, 8)


def _pids_of(run_dir: str) -> list[int]:
    """Processes whose command line names the run dir (supervisors, agents, ranks)."""
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if run_dir.encode() in f.read():
                    out.append(int(p))
        except OSError:
            continue
    return out
