"""What a tier file can do to a reader after the client checked it: nothing fatal, and nothing to the
bytes already handed out. The client reads tier files with pread into private buffers (client.py):
a file truncated under a reader is a short read served from origin, not a SIGBUS; a file changed in
place changes no buffer the caller holds, so a block's xxh3 check and its decode see the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from loongforge.shared.dataset import open_root
from loongforge.shared.errors import IntegrityError
from tests.cache.cache_helpers import counter, settled

pytestmark = pytest.mark.slow

# A reader in its own process: a SIGBUS would end pytest itself.
READER = r"""
import json, sys
from loongforge.cache.client import CacheClient
from loongforge.shared.dataset import load_shard_index
root, sock, name = sys.argv[1:4]
index = load_shard_index(root)
size = index.shard(name).bytes
with CacheClient(root, index, socket_path=sock) as client:
    first = bytes(client.read_range(name, 0, size))
    print("open", flush=True)
    sys.stdin.readline()  # the tier file is truncated meanwhile
    again = bytes(client.read_range(name, 0, size))
    whole = bytes(client.read_shard(name))
    print(json.dumps({"same": first == again == whole, "counts": client.counts}), flush=True)
"""


@pytest.mark.parametrize("to", ["half", "empty"])
def test_tier_file_truncated_under_a_reader_is_read_from_origin(synthetic_root, daemons, to):
    """The daemon's user (here: the test, which is the daemon's uid) truncates a tier file a reader has
    open. The mapped reader died with SIGBUS at its next touch (rc -7, `Fatal Python error: Bus
    error`); now the read is short, served from origin, and the file reported and refilled."""
    root, index = synthetic_root
    name = index.shards[0].name
    d = daemons(root, index)
    reader = subprocess.Popen([sys.executable, "-c", READER, root, d.socket, name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline() == "open\n", reader.stderr.read()
        settled(d)
        path = os.path.join(d.ram_dir, "data", name)
        os.truncate(path, 0 if to == "empty" else os.path.getsize(path) // 2)
        out, err = reader.communicate("go\n", timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, f"reader exited {reader.returncode}\n{err}"
    result = json.loads(out)
    assert result["same"], result
    assert result["counts"]["origin_reads"] == 1 and result["counts"]["daemon_reads"] == 2, result["counts"]
    assert "failed a read after it was checked" in err and "Traceback" not in err, err
    st = d.stats()
    assert counter(st, "reports", "replaced") == 1, st["counters"]  # the daemon dropped it and filled it again
    with open(path, "rb") as f, open(os.path.join(root, name), "rb") as g:
        assert f.read() == g.read()


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def test_bytes_handed_out_do_not_change_with_the_tier_file(synthetic_root, daemons):
    """A block read, then its bytes changed in the tier file: the reader's buffer used to be the
    mapping itself, so bytes checked by xxh3 could change before the decode (the audit's 57 silently
    wrong reads in 30 s). Now the buffer is the reader's own: unchanged; and the next read of the
    changed block fails its xxh3, never decodes wrong pixels."""
    root, index = synthetic_root
    d = daemons(root, index)
    with d.client(fallback=False) as client:
        ds = open_root(root, source=client)
        name, off, length, _, _ = ds.block_entry(0, 0, 0)
        view = client.read_range(name, off, length)
        before = bytes(view)
        expected = ds.read_block(0, 0, 0)
        settled(d)
        path = os.path.join(d.ram_dir, "data", name)
        _flip(path, off + length // 2)
        assert bytes(view) == before  # the copy the caller holds
        with pytest.raises(IntegrityError, match="xxh3"):
            ds.read_block(0, 0, 0)
        _flip(path, off + length // 2)
        np.testing.assert_array_equal(ds.read_block(0, 0, 0), expected)


@pytest.mark.full
def test_blocks_decoded_while_the_tier_file_toggles_are_right_or_refused(synthetic_root, daemons):
    """The audit's measurement, shortened: one thread toggles a byte of every block in the tier file
    while the reader decodes blocks through CacheClient. Every read is either the right pixels or an
    IntegrityError; none is silently wrong (the mapped reader had 57 wrong of ~34,000 in 30 s)."""
    root, index = synthetic_root
    d = daemons(root, index)
    with d.client(fallback=False) as client:
        ds = open_root(root, source=client)
        blocks = [(e, c, b) for e in range(ds.num_episodes) if ds.shard_index.shards[0].name == ds.block_entry(e, 0, 0)[0]
                  for c in range(len(ds.cameras)) for b in range(ds.num_blocks(e))]
        truth = {k: ds.read_block(*k) for k in blocks}
        name = ds.block_entry(*blocks[0])[0]
        settled(d)
        path = os.path.join(d.ram_dir, "data", name)
        offsets = [ds.block_entry(*k)[1] + ds.block_entry(*k)[2] // 2 for k in blocks]
        stop = threading.Event()

        def toggle():
            fd = os.open(path, os.O_RDWR)
            try:
                while not stop.is_set():
                    for o in offsets:
                        b = os.pread(fd, 1, o)
                        os.pwrite(fd, bytes([b[0] ^ 0x5A]), o)
            finally:
                os.close(fd)

        toggler = threading.Thread(target=toggle, daemon=True)
        toggler.start()
        right = refused = wrong = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for k in blocks:
                try:
                    got = ds.read_block(*k)
                except IntegrityError:
                    refused += 1
                    continue
                if np.array_equal(got, truth[k]):
                    right += 1
                else:
                    wrong += 1
        stop.set()
        toggler.join(10)
    assert wrong == 0 and right > 0 and refused > 0, (right, refused, wrong)
