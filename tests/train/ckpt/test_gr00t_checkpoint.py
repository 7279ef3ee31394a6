"""GR00T N1.6 checkpoint directories in and out: the reference's own files (../shared/fixtures/gr00t_n1d6,
written by Isaac-GR00T's save_pretrained) load into the model and export back tensor-identical, name,
shape and dtype; a sharded export loads the same; what does not match is one CheckpointError; and a run
fine-tuned from an export carries its frozen tensors through train -> export unchanged."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors import safe_open

from loongforge.shared.errors import CheckpointError
from tests.outside import copy_fixture
from tests.train.train_launch import assert_ok, launch


def _tensors(d) -> dict[str, torch.Tensor]:
    from loongforge.train.ckpt.gr00t import weight_files

    out = {}
    for f in weight_files(str(d)):
        with safe_open(f, framework="pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return copy_fixture("gr00t_n1d6", tmp_path_factory.mktemp("ref") / "gr00t_n1d6")


def _loaded(d):
    from loongforge.train.ckpt.gr00t import load_gr00t_weights
    from loongforge.train.model.config import from_gr00t_json, read_gr00t_dir_config
    from loongforge.train.model.model import Gr00tN1d6

    eagle = d / "eagle_config_reduced.json"  # the reference's backbone config lives in Isaac-GR00T's repo
    cfg = (from_gr00t_json(json.loads((d / "config.json").read_text()), json.loads(eagle.read_text()))
           if eagle.exists() else read_gr00t_dir_config(str(d / "config.json")))
    model = Gr00tN1d6(cfg, attention="sdpa")
    return model, load_gr00t_weights(model, str(d))


def _export(model, dtypes, out, **kw):
    from loongforge.train.ckpt.gr00t import TIED, export_gr00t

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    state = {k: v for k, v in model.state_dict().items() if k not in TIED}
    return export_gr00t(state, model.cfg, str(out), trainable=trainable, stored=dtypes, processor={},
                        statistics={}, embodiment={"new_embodiment": 0}, tokenizer=None, **kw)


@pytest.mark.parametrize("sharded", [False, True])
def test_reference_checkpoint_exports_back_tensor_identical(fixture, tmp_path, monkeypatch, sharded):
    from loongforge.train.ckpt import gr00t

    model, dtypes = _loaded(fixture)
    if sharded:  # transformers' layout past 5 GB: model-0000N-of-0000M.safetensors + the index
        monkeypatch.setattr(gr00t, "SHARD_BYTES", 64 << 10)
    files = _export(model, dtypes, tmp_path / "out")
    assert ("model.safetensors.index.json" in files) == sharded and "config.json" in files
    ref, got = _tensors(fixture), _tensors(tmp_path / "out")
    assert set(got) == set(ref) and len(ref) == 170  # the reference's names, the tied lm_head left out as HF does
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    again, _ = _loaded(tmp_path / "out")  # and it loads back: config.json written by us, read by us
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_export_follows_the_umask(fixture, tmp_path, umask):
    """`loongforge export` wrote its directory 0700 (mkdtemp) and model.safetensors 0600 (the writer):
    nobody but its owner could read an export. Now the modes a plain write gives, as torch.save and
    save_pretrained leave theirs: 0755 / 0644 under the usual 022."""
    model, dtypes = _loaded(fixture)
    old = os.umask(umask)
    try:
        files = _export(model, dtypes, tmp_path / "out")
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "out").st_mode & 0o777) == oct(0o777 & ~umask)
    modes = {f: oct(os.stat(tmp_path / "out" / f).st_mode & 0o777) for f in files}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_a_checkpoint_that_does_not_match_is_one_error(fixture, tmp_path):
    from safetensors.torch import save_file

    from loongforge.train.ckpt.gr00t import check_gr00t_weights, load_gr00t_weights

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((fixture / "config.json").read_text())
    t = _tensors(fixture)
    t["action_head.vlln.weight"] = torch.zeros(3)  # another shape
    del t["action_head.position_embedding.weight"]  # missing
    t["extra.weight"] = torch.zeros(1)  # unexpected
    save_file(t, str(bad / "model.safetensors"))
    model, _ = _loaded(fixture)
    with pytest.raises(CheckpointError) as err:
        load_gr00t_weights(model, str(bad))
    msg = str(err.value)
    assert "\n" not in msg and "1 of another shape" in msg and "1 missing" in msg and "1 unexpected" in msg, msg
    with pytest.raises(CheckpointError) as err:  # the same, from the headers alone (preflight, before any write)
        check_gr00t_weights(model.cfg, str(bad))
    assert str(err.value) == msg
    os.unlink(bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_gr00t_weights(model, str(bad))


@pytest.mark.parametrize("case", ["missing", "no-tokenizer"])
def test_init_from_errors_are_one_line_exit_2(fixture, train_root, tmp_path, case):
    root, _ = train_root
    src = tmp_path / "ckpt"
    if case == "no-tokenizer":  # the reference's reduced checkpoint (Qwen3-style vocabulary), no tokenizer files
        src.mkdir()
        config = json.loads((fixture / "config.json").read_text())
        config["eagle_config"] = json.loads((fixture / "eagle_config_reduced.json").read_text())
        (src / "config.json").write_text(json.dumps(config))
        os.symlink(fixture / "model.safetensors", src / "model.safetensors")
    src = str(src)
    proc = launch([sys.executable, "-m", "loongforge", "train", "--data", root, "--run-dir", str(tmp_path / "run"),
                   "--init-from", src, "--steps", "1"], cwd=str(tmp_path), timeout=180)
    err = [line for line in proc.stderr.strip().splitlines() if " INFO " not in line]  # the launch's log lines
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert ("not a directory" if case == "missing" else "--tokenizer DIR") in err[0], err[0]


def _reduced_dir(fixture, d, weights):
    """The reference's reduced checkpoint as a directory `--init-from` reads (its backbone config folded
    into config.json), with `weights(path)` writing its model.safetensors."""
    d.mkdir()
    config = json.loads((fixture / "config.json").read_text())
    config["eagle_config"] = json.loads((fixture / "eagle_config_reduced.json").read_text())
    (d / "config.json").write_text(json.dumps(config))
    weights(d / "model.safetensors")
    return str(d)


def _without_one(fixture):
    from safetensors.torch import save_file

    def write(path):
        t = _tensors(fixture)
        del t["action_head.position_embedding.weight"]
        save_file(t, str(path))
    return write


def _one_reshaped(fixture):
    from safetensors.torch import save_file

    def write(path):
        t = _tensors(fixture)
        t["action_head.vlln.weight"] = torch.zeros(3)
        save_file(t, str(path))
    return write


def _truncated(fixture):
    def write(path):
        data = (fixture / "model.safetensors").read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return write


@pytest.mark.parametrize("case", ["truncated", pytest.param("a tensor missing", marks=pytest.mark.full),
                                  pytest.param("a tensor of another shape", marks=pytest.mark.full)])
def test_init_from_a_checkpoint_that_does_not_load_is_one_line_exit_2_nothing_written(fixture, train_root, tmp_path,
                                                                                      case):
    """Isaac-GR00T's own reduced checkpoint, one tensor short, one reshaped, or cut in half: exit 1 (the
    first two) or a 19-line SafetensorError traceback (the third), each leaving RUN_DIR/run.lock. The
    weights' names and shapes are now checked from the files' headers before anything is written."""
    root, _ = train_root
    weights = {"a tensor missing": _without_one, "a tensor of another shape": _one_reshaped,
               "truncated": _truncated}[case](fixture)
    src = _reduced_dir(fixture, tmp_path / "ckpt", weights)
    run = tmp_path / "run"
    proc = launch([sys.executable, "-m", "loongforge", "train", "--data", root, "--run-dir", str(run),
                   "--init-from", src, "--tokenizer", "bytes", "--steps", "1"],
                  cwd=str(tmp_path), timeout=180)
    err = [line for line in proc.stderr.strip().splitlines() if " INFO " not in line]  # the launch's log lines
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert f"--init-from {src}" in err[0] and {"a tensor missing": "1 missing", "a tensor of another shape":
                                                "1 of another shape", "truncated": "unreadable"}[case] in err[0], err[0]
    assert not run.exists(), sorted(os.listdir(run))


@pytest.mark.slow
def test_fine_tune_from_an_export_keeps_its_frozen_tensors(train_root, tmp_path):
    """tiny from scratch (2 steps) -> export -> --init-from it with the tower and the LLM frozen (2 steps)
    -> export (in this process, without --data): the frozen tensors come out bit-identical, the trained ones changed, every dtype kept."""
    root, _ = train_root
    common = ["--data", root, "--batch-size", "8", "--steps", "2", "--save-every", "2", "--no-ds-breakdown",
              "--report-to", "none", "--workers", "0"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert_ok(launch([sys.executable, "-m", "loongforge.train", "--run-dir", a, "--recipe", "tiny", *common],
                     cwd=str(tmp_path)))
    assert_ok(launch([sys.executable, "-m", "loongforge", "export", a, str(tmp_path / "ea"), "--data", root],
                     cwd=str(tmp_path), timeout=180))
    assert_ok(launch([sys.executable, "-m", "loongforge.train", "--run-dir", b, "--init-from", str(tmp_path / "ea"),
                      "--no-tune-visual", "--no-tune-llm", "--tune-top-llm-layers", "0", *common],
                     cwd=str(tmp_path)))
    from loongforge.cli import main  # the second export in this process (the first is the command's process)

    assert main(["export", b, str(tmp_path / "eb")]) == 0  # no --data: the processor is in the checkpoint
    ea, eb = _tensors(tmp_path / "ea"), _tensors(tmp_path / "eb")
    assert set(ea) == set(eb)
    assert all(ea[n].dtype == eb[n].dtype for n in ea)  # init_dtypes: what came in goes out
    frozen = [n for n in ea if n.startswith(("backbone.model.vision_model.", "backbone.model.language_model."))]
    trained = [n for n in ea if n.startswith("action_head.model.")]
    assert frozen and trained
    assert all(torch.equal(ea[n], eb[n]) for n in frozen)
    assert not all(torch.equal(ea[n], eb[n]) for n in trained)
    cfg = json.load(open(tmp_path / "eb" / "config.json"))
    assert cfg["tune_visual"] is False and cfg["tune_llm"] is False
