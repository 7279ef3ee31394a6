"""One storage tier = a directory of shard files with a byte budget.

RAM is a tier in /dev/shm (tmpfs), so trainer workers mmap the very pages the
daemon wrote: no copy, no bytes through the socket. SSD is a tier on local
disk that survives restarts; its catalog is rebuilt (and re-verified) from
disk at start. Files are written to a temp name and renamed into place, so a
reader that mapped the old inode keeps valid bytes even while we replace or
unlink it. Thread safety is the caller's (store.py holds one lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile

from loongforge.cache.access import DIR_MODE, FILE_MODE, check_tier_root, file_problem, make_dirs, open_no_follow
from loongforge.shared import paths, storage
from loongforge.shared.errors import ConfigError, IntegrityError
from loongforge.shared.index import ShardIndex

log = logging.getLogger(__name__)
TIER_FORMAT = "loongforge-cache-tier"
TIER_VERSION = 1
MARKER = "CACHE_FORMAT.json"
LOCK = ".lock"
BASE_PAGE = os.sysconf("SC_PAGE_SIZE")


def huge_page_size() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Hugepagesize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 2 << 20


class Tier:
    def __init__(self, name: str, root: str, budget: int, huge: str | None = None):
        self.name = name
        self.root = os.path.abspath(root)
        self.data_dir = os.path.join(self.root, "data")  # everything under it is ours to delete
        self.budget = budget
        # Memory and disk are spent in pages, not file bytes: a 49 KiB shard takes 52 KiB of tmpfs.
        # `huge` is the tmpfs `huge=` option of a RAM tier (tmpfs_huge_option), None for a disk tier.
        self.huge_page = huge_page_size() if huge in ("huge=always", "huge=within_size") else 0
        self.huge_always = huge == "huge=always"
        self.entries: dict[str, int] = {}  # shard -> bytes charged (whole pages), complete and verified
        self.reserved: dict[str, int] = {}  # shard -> bytes charged, being written
        self._lock_fd: int | None = None  # flock held for the daemon's lifetime
        # Writes off while the disk is full (policy in store.py): None = on, else when a write may re-check.
        self.recheck_at: float | None = None
        self.recheck_s = 0.0
        self.off_reason = ""

    def charge(self, size: int) -> int:
        """Bytes of memory/disk a file of `size` bytes occupies in this tier."""
        hp = self.huge_page
        if hp and self.huge_always:
            return -(-size // hp) * hp
        whole = size - size % hp if hp else 0  # within_size: huge pages only where they fit inside i_size
        return whole + -(-(size - whole) // BASE_PAGE) * BASE_PAGE

    @property
    def used(self) -> int:
        return sum(self.entries.values()) + sum(self.reserved.values())

    def __contains__(self, shard: str) -> bool:
        return shard in self.entries

    def path(self, shard: str) -> str:
        return os.path.join(self.data_dir, paths.check_relative(shard))

    def open_dir(self) -> None:
        """Create the directory, or check the on-disk format of an existing one,
        and lock it: two daemons sharing a tier would delete each other's files."""
        check_tier_root(self.root, self.name)  # before anything is created: not inside another user's directory
        make_dirs(self.data_dir)  # parents it creates get DIR_MODE too, never the umask's 0777
        for d in (self.root, self.data_dir):
            os.chmod(d, DIR_MODE)
        if self._lock_fd is None:
            fd = os.open(os.path.join(self.root, LOCK), os.O_RDWR | os.O_CREAT, FILE_MODE)
            try:
                os.fchmod(fd, FILE_MODE)  # O_CREAT's mode is narrowed by the umask
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(f"{self.name} tier {self.root} is in use by another cache daemon; "
                                  f"give this one its own --{self.name}-dir") from None
            self._lock_fd = fd
        marker = os.path.join(self.root, MARKER)
        if os.path.exists(marker):
            try:
                with open(marker) as f:
                    doc = json.load(f)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{self.name} tier {marker}: unreadable ({exc}); delete {self.root}") from exc
            if doc.get("format") != TIER_FORMAT or doc.get("version") != TIER_VERSION:
                raise ConfigError(f"{self.name} tier {self.root} holds format {doc}, this build writes "
                                  f"{TIER_FORMAT} v{TIER_VERSION}: delete the directory or point elsewhere")
        else:
            storage.write_bytes_atomic(marker, json.dumps({"format": TIER_FORMAT, "version": TIER_VERSION}).encode())
            os.chmod(marker, FILE_MODE)

    def remove_dir(self) -> None:
        """Graceful stop of a RAM tier: files, format marker and lock go; the root too if now empty.
        Only a tier this process locked: another daemon's (the lock refused us) is left alone."""
        if self._lock_fd is None:
            return
        self.wipe()
        _unlink(os.path.join(self.root, MARKER))
        _unlink(os.path.join(self.root, LOCK))  # unlink while we still hold the flock, then let go
        os.close(self._lock_fd)
        self._lock_fd = None
        try:
            os.rmdir(self.root)
        except OSError:
            pass  # something else lives there (a shared mount point): leave it

    def wipe(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.entries.clear()
        self.reserved.clear()

    def rebuild(self, index: ShardIndex, full: bool = True) -> tuple[list[str], list[str]]:
        """Rebuild the catalog from the files on disk, checking each against the
        index: size always, sha256 too if `full`. Returns (kept, dropped):
        dropped = corrupt, truncated or no longer in the index. Without `full`
        a bit flip is caught later: every SSD -> RAM fill re-hashes. A file that
        another uid owns or may write is dropped too, and directories get DIR_MODE
        back (a tier made by an older build under umask 077 had 0700 ones)."""
        kept, dropped = [], []
        self.entries.clear()
        for dirpath, _, files in os.walk(self.data_dir):
            try:
                os.chmod(dirpath, DIR_MODE)
            except PermissionError:
                pass  # not ours (another uid made it): its files fail file_problem below and are dropped
            for fname in files:
                full_path = os.path.join(dirpath, fname)
                rel = os.path.relpath(full_path, self.data_dir).replace(os.sep, "/")
                try:
                    entry = index.shard(rel)
                    st = os.lstat(full_path)  # a symlink is not a regular file: dropped
                    problem = file_problem(st, os.geteuid(), entry.bytes)
                    if problem:
                        raise IntegrityError(f"{rel}: {problem}")
                    if full and storage.sha256_file(full_path)[0] != entry.sha256:
                        raise IntegrityError(f"{rel}: sha256 differs from the index")
                except (KeyError, ValueError, IntegrityError, OSError) as exc:
                    log.warning("%s tier: dropping %s (%s)", self.name, rel, exc)
                    _unlink(full_path)
                    dropped.append(rel)
                    continue
                self.entries[rel] = self.charge(st.st_size)
                kept.append(rel)
        return kept, dropped

    def write(self, shard: str, data) -> str:
        """Temp file + rename; raises OSError (ENOSPC included) with nothing left behind."""
        target = self.path(shard)
        make_dirs(os.path.dirname(target))  # DIR_MODE whatever the umask: group members must reach the file
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, FILE_MODE)  # trainer workers may run as another user in the daemon's group
            os.replace(tmp, target)
        except BaseException:
            _unlink(tmp)
            raise
        return target

    def check_file(self, shard: str, size: int, sha256: str) -> str | None:
        """The daemon's own check of its copy of `shard` (one a client refused): a regular file, not a
        symlink, of this uid, writable only by it, of the index's size and sha256. None if it passes,
        else what is wrong."""
        try:
            fd = open_no_follow(self.path(shard))
        except OSError as exc:
            return f"cannot open it: {exc}"
        with os.fdopen(fd, "rb") as f:
            problem = file_problem(os.fstat(f.fileno()), os.geteuid(), size)
            if problem:
                return problem
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        return None if digest == sha256 else f"sha256 {digest[:16]}… != index {sha256[:16]}…"

    # -- writes off while the disk is full (when: store.py) --------------------------
    @property
    def writes_off(self) -> bool:
        return self.recheck_at is not None

    def may_write(self, now: float) -> bool:
        """False while writes are off; once the re-check time has come, True for one caller (its
        write is the re-check), and the next re-check moves back by the current wait."""
        if self.recheck_at is None:
            return True
        if now < self.recheck_at:
            return False
        self.recheck_at = now + self.recheck_s
        return True

    def turn_writes_off(self, now: float, first_s: float, max_s: float, reason: str) -> float:
        """No writes until a re-check `first_s` from now; each re-check that finds the disk still full
        doubles the wait, up to `max_s`. Returns the wait."""
        self.recheck_s = first_s if self.recheck_at is None else min(max_s, self.recheck_s * 2)
        self.recheck_at = now + self.recheck_s
        self.off_reason = reason
        return self.recheck_s

    def turn_writes_on(self) -> None:
        self.recheck_at, self.recheck_s, self.off_reason = None, 0.0, ""

    def map(self, shard: str) -> memoryview:
        return storage.map_file(self.path(shard))

    def remove(self, shard: str) -> None:
        self.entries.pop(shard, None)
        self.reserved.pop(shard, None)
        _unlink(self.path(shard))

    def summary(self) -> dict:
        out = {"dir": self.root, "budget": self.budget, "used": self.used, "shards": len(self.entries),
               "disabled": self.writes_off}  # takes no new shards (disk full); what it holds is still served
        if self.writes_off:
            out["disabled_reason"] = self.off_reason
        return out



def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def tmpfs_huge_option(path: str) -> str | None:
    """The `huge=` option of the tmpfs holding `path`; None if not tmpfs (or unknown)."""
    best, found = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fstype, options = line.split()[:4]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best = mnt
                    found = None if fstype != "tmpfs" else next(
                        (o for o in options.split(",") if o.startswith("huge=")), "huge=never")
    except OSError:
        return None
    return found
