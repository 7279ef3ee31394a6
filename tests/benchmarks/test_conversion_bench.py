"""P1/rgb-conversion's measurement, alone and as the bench calls it, on tiny frames (the
figures themselves come from the bench run, never from a test)."""

from types import SimpleNamespace

import torch

from loongforge.benchmarks.cli import main as bench
from loongforge.benchmarks.micro import conversion


def test_row_measurement_on_the_bench_batch_shape():
    ds = SimpleNamespace(height=16, width=24, frames_per_sample=2, slots=("a", "b"), color_matrix="bt709",
                         color_range="full")
    ctx = SimpleNamespace(prep=SimpleNamespace(info=ds),
                          cfg=SimpleNamespace(batch_size=3, seed=1), measured={})
    frames = conversion._batch_frames(ctx)
    assert [tuple(f.shape) for f in frames] == [(6, 24, 24)] * 2  # batch x K frames per camera
    m = conversion.measure(ctx, batches=2)
    assert set(m) == {"old", "ops", "new"} and len(m["new"]["cpu"].values) == 2
    assert all(s.median > 0 for d in m.values() for s in d.values())


def test_standalone_run_reports_old_new_and_the_output_pass_floor(capsys):
    assert bench(["conversion", "--size", "32", "--frames", "4", "--batches", "2"]) == 0
    out = capsys.readouterr().out
    for line in ("old:", "ops:", "new:", "floor:", "new / old:", "floor / old:", "load average"):
        assert line in out
    # The floor does the output passes only, on the output the conversion returns.
    x = torch.randint(0, 256, (3, 48, 32), dtype=torch.uint8)
    assert conversion.output_passes_only(x, "bt601", "limited", mean=0.5, std=0.25).shape == (3, 3, 32, 32)
