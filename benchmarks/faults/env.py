"""The faults of benchmarks/faults/run.py that need something set up around the run or checked after it: a Redis
server behind the cache daemon, a small real filesystem under the checkpoints, a corrupt `latest` checkpoint
that the relaunch must reject. (The corrupt copy of the shard root: faults/data.py.)

Each fault here is a `prepare(work, root, name) -> Setup` (before the run starts) plus a trigger (as in
faults/run.py) and an `annotate(row, run, setup)` that adds what only this fault can say (skipped sample ids, the
checkpoint that stayed `latest`). They keep the suite's accounting: sample ids of every step row against the
global order.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import sys
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from loongforge.train.ckpt import files as ckpt_files

# tmpfs size for the checkpoint dir: big enough for 2 checkpoints of the tiny recipe with room to spare; the
# trigger fills it with a ballast once the size of one real checkpoint is known.
DISK_MB = 256
BALLAST_FREE = 64 << 10  # bytes the ballast leaves free: less than any checkpoint's model/optimizer file


@dataclass
class Setup:
    root: str  # the shard root the run (and its cache daemon) reads
    daemon_args: tuple = ()
    cleanup: list = field(default_factory=list)
    info: dict = field(default_factory=dict)
    skip_why: str | None = None  # set when the fault cannot be staged here: the row says why

    def close(self) -> None:
        for fn in reversed(self.cleanup):
            fn()


def log_time(line: str) -> float | None:
    """The timestamp of a logging line ("%(asctime)s ..."), or None."""
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


# -- Redis SIGKILL: the cache daemon coordinates through a real redis-server; kill -9 it mid-run -------------
def prepare_redis(work: Path, root: str, name: str) -> Setup:
    binary = shutil.which("redis-server")
    if binary is None:
        return Setup(root, skip_why="redis-server not installed (make setup installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    setup = Setup(root, daemon_args=("--redis-url", f"redis://127.0.0.1:{port}/0", "--heartbeat-s", "0.5"))
    setup.info["redis"] = proc
    setup.cleanup.append(lambda: (proc.kill(), proc.wait()))
    return setup


def f_redis_sigkill(run):
    run.wait_steps(4)
    t = run.mark_fault()
    run.setup.info["redis"].kill()
    return t


def annotate_redis(row: dict, run, setup: Setup) -> None:
    lines = [ln for ln in run.daemon.log if "redis" in ln and "unreachable" in ln]
    t = next((log_time(ln) for ln in lines if (log_time(ln) or 0) >= row["t_inject"] - 1), None)
    if t is not None:
        row["detected_after_s"] = round(max(0.0, t - row["t_inject"]), 1)
    row["action"] = ("cache daemon: redis unreachable -> serving without coordination (local tiers + origin), "
                     "reconnecting with backoff; trainer untouched" if lines else
                     "no redis error logged by the daemon") + ("; no restart" if row["relaunches"] == 0 else "")


# -- checkpoint disk full: the checkpoints dir on a real tmpfs, filled once one checkpoint's size is known ----
def prepare_disk_full(work: Path, root: str, name: str) -> Setup:
    mnt = work / f"{name}-tmpfs"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return Setup(root, skip_why=f"cannot mount a tmpfs here: {out.stderr.strip()} (needs root)")
    run_dir = work / name
    run_dir.mkdir()
    os.symlink(mnt, run_dir / "checkpoints")  # metrics.jsonl and the log stay on the big disk
    setup = Setup(root)
    setup.info["mnt"] = mnt
    setup.cleanup.append(lambda: subprocess.run(["umount", "-l", str(mnt)], check=False))
    return setup


def f_disk_full(run):
    """Once the first checkpoint is published, freeze both ranks (SIGSTOP: no save takes room meanwhile), fallocate
    a ballast that leaves BALLAST_FREE bytes, and let them go on; until a save has failed, top the ballast up
    whenever room appears again (a save that was nearly done publishes and prunes an older checkpoint). Once a
    save has failed, the ballast goes, so a later interval must succeed."""
    mnt = run.setup.info["mnt"]
    while not os.path.exists(mnt / "latest"):
        if run.proc.poll() is not None:
            raise RuntimeError("run ended before its first checkpoint")
        time.sleep(0.05)
    pids = [run.rank_pid(r) for r in (0, 1)]
    fd = os.open(mnt / "ballast", os.O_CREAT | os.O_WRONLY, 0o600)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:  # milliseconds: fallocate writes nothing, so the watchdog's 5 s never come near
        st = os.statvfs(mnt)
        run.setup.info["ckpt_bytes"] = (st.f_blocks - st.f_bfree) * st.f_frsize
        t = run.mark_fault()
        _top_up(fd, mnt)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    log = Path(run.log.name)
    while "NOT saved" not in log.read_text(errors="replace") and run.proc.poll() is None:
        _top_up(fd, mnt)
        time.sleep(0.02)
    os.close(fd)
    os.unlink(mnt / "ballast")
    run.setup.info["ballast_removed"] = time.time()
    return t


def _top_up(fd: int, mnt: Path) -> None:
    st = os.statvfs(mnt)
    extra = st.f_bavail * st.f_frsize - BALLAST_FREE
    if extra > 0:
        try:
            os.posix_fallocate(fd, os.fstat(fd).st_size, extra)
        except OSError as exc:  # a save took the room first: the disk is full either way, as wanted
            if exc.errno != errno.ENOSPC:
                raise


def annotate_disk_full(row: dict, run, setup: Setup) -> None:
    lines = [ln for ln in Path(run.log.name).read_text(errors="replace").splitlines() if "NOT saved" in ln]
    if lines and (t := log_time(lines[0])) is not None:
        row["detected_after_s"] = round(max(0.0, t - row["t_inject"]), 1)
    mnt = setup.info["mnt"]
    latest = (mnt / "latest").read_text().strip() if (mnt / "latest").exists() else None
    try:
        ckpt_files.verify_manifest(run.run_dir, latest)
        intact = latest is not None
    except Exception as exc:  # noqa: BLE001 - the row says what was wrong
        intact, latest = False, f"{latest} ({type(exc).__name__}: {exc})"
    failed = sorted({ln.split("checkpoint ")[1].split()[0] for ln in lines})
    enospc = any("No space left" in ln for ln in lines)
    row["action"] = (f"save of {', '.join(failed) or '-'} failed ({'ENOSPC' if enospc else 'no ENOSPC'}: ranks "
                     f"frozen while a ballast left {BALLAST_FREE >> 10} KiB free on the {DISK_MB} MiB tmpfs, "
                     f"{setup.info.get('ckpt_bytes', 0) >> 10} KiB of checkpoints on it): partial files removed, "
                     f"training went on; ballast removed after the first failure; latest = {latest} at the end, "
                     f"sha256 manifest {'verified' if intact else 'NOT verified'}")
    row["saves_failed"] = failed
    # Recovered: every step trained, the ENOSPC was caught, and the `latest` left is whole (verified).
    row["recovered"] = row["recovered"] and enospc and intact


# -- corrupt checkpoint: the `latest` the relaunch WILL load, with nothing left running that could publish a newer one
def f_corrupt_checkpoint(run):
    """Freeze both ranks (SIGSTOP stops their checkpoint-writer threads too, so `latest` cannot move; rank 0, the
    publisher, first), flip one byte in the largest file of `latest`'s manifest, then SIGKILL them. The relaunch
    (1 rank: the capacity file) must reject that checkpoint by its sha256 and load the one before it."""
    run.wait_steps(7)
    pids = [run.rank_pid(r) for r in (0, 1)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    t = run.mark_fault()  # nothing trains or publishes from here: the count of finished steps is final
    ck = Path(run.run_dir) / "checkpoints"
    tag = (ck / "latest").read_text().strip()
    files = json.loads((ck / tag / "manifest.json").read_text())["files"]
    victim = ck / tag / max(files, key=lambda n: (files[n]["bytes"], n))
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    run.capacity.write_text("1")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    run.setup.info.update(corrupt_tag=tag, corrupt_file=str(victim), stopped_after=run.steps_before_fault)
    return t


def annotate_corrupt_checkpoint(row: dict, run, setup: Setup) -> None:
    """The row holds only if the relaunch's {"event": "ckpt_fallback"} record rejects the corrupted tag, names the
    flipped file, and loads an earlier checkpoint, and the relaunch says it resumed there; otherwise the row
    fails (recovered n, exit code 1) and says which check did not hold."""
    info, problems = setup.info, []
    tag = info.get("corrupt_tag")
    recs = [e for e in run.rows() if e.get("event") == "ckpt_fallback" and e.get("latest") == tag]
    log = Path(run.log.name).read_text(errors="replace")
    if tag is None:
        problems.append("the trigger corrupted nothing")
    elif not recs:
        problems.append(f"no ckpt_fallback record rejecting {tag}: the relaunch did not fall back")
    else:
        rec = recs[0]
        loaded, loaded_step = rec["loaded"], int(rec["loaded"][4:])
        if not any(info["corrupt_file"] in r for r in rec["rejected"]):
            problems.append(f"the record does not name {info['corrupt_file']}: {rec['rejected']}")
        if loaded_step >= int(tag[4:]):
            problems.append(f"loaded {loaded}, not a checkpoint before {tag}")
        # The supervisor may first convert it to the new rank count (resilience/elastic/reshard.py: stepNNNNNNNN_wWzZtT).
        if not re.search(rf"resumed from {loaded}(_w\w+)? at step {loaded_step}\b", log):
            problems.append(f"no 'resumed from {loaded}[_wWzZtT] at step {loaded_step}' line in the log")
        conv = [e for e in run.rows() if e.get("event") == "elastic" and e.get("action") == "reshard"
                and e.get("from_tag") == loaded]
        row["detected_after_s"] = round(rec["t"] - row["t_inject"], 1)  # includes the relaunch's start-up
        ended = [e["t"] for e in run.rows() if e.get("event") == "elastic" and e.get("action") == "fault"]
        row["launch_ended_after_s"] = round(ended[0] - row["t_inject"], 1) if ended else None
        row["steps_redone"] = info["stopped_after"] - loaded_step  # steps finished before the fault - resumed at
        row["fallback"] = {"rejected": tag, "file": os.path.relpath(info["corrupt_file"], run.run_dir),
                           "loaded": loaded}
        row["action"] = (f"both ranks frozen (SIGSTOP) after step {info['stopped_after'] - 1}, 1 byte flipped in "
                         f"{row['fallback']['file']} of `latest`, ranks SIGKILLed (launch ended after "
                         f"{row['launch_ended_after_s']} s); relaunch on 1 rank: {tag} "
                         f"rejected (sha256 mismatch, ckpt_fallback record), {loaded} loaded"
                         + (f" (converted to {conv[0]['to']} first: {'ok' if conv[0].get('ok') else 'failed'})"
                            if conv else "")
                         + f", steps {loaded_step}-{info['stopped_after'] - 1} redone")
    if problems:
        row["check_failed"] = "; ".join(problems)
        row["action"] = f"CHECK FAILED: {row['check_failed']}"
        print(f"corrupt_checkpoint: CHECK FAILED: {row['check_failed']} (log: {run.log.name})", file=sys.stderr)
    row["recovered"] = row["recovered"] and not problems


# -- cache SSD tier full: the daemon's SSD tier on a real tmpfs, filled by a ballast as the run starts ----------
SSD_KB = 256


def prepare_ssd_full(work: Path, root: str, name: str) -> Setup:
    mnt = work / f"{name}-ssd"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SSD_KB}k", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return Setup(root, skip_why=f"cannot mount a tmpfs here: {out.stderr.strip()} (needs root)")
    setup = Setup(root, daemon_args=("--ssd-dir", str(mnt)))  # the last --ssd-dir wins over the harness's own
    setup.info["mnt"] = mnt
    setup.cleanup.append(lambda: subprocess.run(["umount", "-l", str(mnt)], check=False))
    return setup


def f_ssd_full(run):
    """Fill the SSD tier's disk as the run starts (the daemon is up: it cannot start on a full disk, it writes
    its tier files there first): every shard it then writes through to the SSD hits ENOSPC."""
    t = run.mark_fault()
    try:
        with open(run.setup.info["mnt"] / "ballast", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    return t


def annotate_ssd_full(row: dict, run, setup: Setup) -> None:
    full = [ln for ln in run.daemon.log if "disk full" in ln and "ssd tier" in ln]
    errors = [ln for ln in run.daemon.log if " ERROR " in ln]
    t = next((log_time(ln) for ln in full), None)
    if t is not None:
        row["detected_after_s"] = round(max(0.0, t - row["t_inject"]), 1)
    row.update(ssd_full_warnings=len(full), daemon_errors=len(errors))
    row["action"] = (f"cache daemon: SSD tier full -> RAM-only for new shards, {len(full)} WARNING, {len(errors)} "
                     "ERROR lines, re-checks with back-off; trainer untouched" if full else
                     "no disk-full WARNING from the daemon") + ("; no restart" if row["relaunches"] == 0 else "")
    row["recovered"] = bool(row["recovered"] and len(full) == 1)
