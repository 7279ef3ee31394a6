"""What a W&B run holds locally: the history rows of its `.wandb` files under RUN_DIR/wandb.

W&B writes every run, online or offline, to a local transaction log (`run-ID.wandb` in one folder per
session: `offline-run-TIME-ID/` or `run-TIME-ID/`) and `wandb sync` uploads exactly those records.
The log is LevelDB's record format behind a 7-byte header (":W&B", magic 0xBEE1, version 0): 32 KiB
blocks of records, each a 7-byte header (CRC-32 of type + payload, payload length, type: full,
first, middle, last) and a payload; a record that would not fit a block's tail is cut in pieces.
Each assembled payload is one `wandb.proto` Record.

The tracker reads it on a resume (the steps the run already holds are not logged twice: an offline
run cannot ask the server, as an online resume does), and the tests read a run back through it.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib

from loongforge.shared.errors import FormatError

BLOCK = 32 << 10
HEADER = struct.Struct("<4sHB")  # ident, magic, version
RECORD = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_files(run_dir: str, run_id: str) -> list[str]:
    """The `.wandb` files of run `run_id` under RUN_DIR/wandb, oldest session first. A session folder
    is `{offline-,}run-YYYYMMDD_HHMMSS-ID`, with `-N` appended by W&B when that name was taken (two
    sessions started within one second)."""
    out = []
    for path in glob.glob(os.path.join(run_dir, "wandb", f"*run-*-{run_id}*", f"run-{run_id}.wandb")):
        when, _, rest = os.path.basename(os.path.dirname(path)).split("run-", 1)[1].partition(f"-{run_id}")
        if rest == "" or (rest[:1] == "-" and rest[1:].isdigit()):
            out.append(((when, int(rest[1:] or 0)), path))
    return [path for _, path in sorted(out)]


def payloads(path: str):
    """The record payloads of one `.wandb` file, in order. A torn tail (the writer was killed
    mid-record) ends the file; a checksum mismatch before it is a corrupt file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER.size or HEADER.unpack_from(data) != (b":W&B", 0xBEE1, 0):
        raise FormatError(f"{path}: not a W&B transaction log (version 0)")
    pos, parts = HEADER.size, None
    while pos + RECORD.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD.size:  # a block's tail too short for a header is zero padding
            pos += left
            continue
        crc, n, kind = RECORD.unpack_from(data, pos)
        body = data[pos + RECORD.size:pos + RECORD.size + n]
        if kind == 0 and n == 0:  # padding up to the next block
            pos += left
            continue
        if len(body) < n:
            return  # torn tail
        if zlib.crc32(body, zlib.crc32(bytes([kind]))) != crc:
            raise FormatError(f"{path}: record at byte {pos} fails its checksum")
        pos += RECORD.size + n
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = [body]
        elif kind in (MIDDLE, LAST) and parts is not None:
            parts.append(body)
            if kind == LAST:
                yield b"".join(parts)
                parts = None


def history(path: str) -> list[tuple[int, dict]]:
    """(step, {key: value}) of every history row of one `.wandb` file, in order; W&B's own keys
    (`_step`, `_runtime`, `_timestamp`) left out, values decoded from their JSON."""
    from wandb.proto import wandb_internal_pb2  # the optional [track] extra: only W&B runs get here

    rows = []
    for payload in payloads(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
        rows.append((int(rec.history.step.num), {k: v for k, v in items.items() if not k.startswith("_")}))
    return rows


def last_step(run_dir: str, run_id: str, key: str) -> int | None:
    """The last step of run `run_id` whose history row holds `key` (None: no such row yet)."""
    steps = [s for p in run_files(run_dir, run_id) for s, row in history(p) if key in row]
    return max(steps) if steps else None
