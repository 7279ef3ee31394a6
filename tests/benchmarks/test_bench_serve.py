"""`loongforge bench serve`, reduced: a real server, real client processes, the table and JSON written
with every row split the way the README reads it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_serve_writes_its_latency_table(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "loongforge", "bench", "serve", "--recipes", "tiny", "--batches", "1",
                           "2", "--clients", "1", "2", "--requests", "3", "--warmup", "1", "--image-size", "32",
                           "--threads", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (doc_file,) = tmp_path.glob("serve-*-cpu.json")
    doc = json.loads(doc_file.read_text())
    assert [(r["batch"], r["clients"], r["requests"]) for r in doc["rows"]] == [(1, 1, 3), (1, 2, 6), (2, 1, 3),
                                                                               (2, 2, 6)]
    for r in doc["rows"]:
        assert 0 < r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]
        assert all(r["server_ms"][k] > 0 for k in ("decode", "preprocess", "model", "encode"))
        assert r["server_ms"]["model"] < r["p50_ms"], r  # the same requests, timed inside and outside
    (flow,) = doc["flow"]
    assert flow["model_ms_steps4_samples8"] > flow["model_ms_steps4_samples1"] > 0
    assert 0 <= flow["k8_mean_share_of_8sample"] < 1 and len(doc["load_average_end"]) == 3
    table = doc_file.with_suffix(".txt").read_text()
    assert table == proc.stdout and "tiny       B=2  clients=2  p50" in table and "the K-mean adds" in table
