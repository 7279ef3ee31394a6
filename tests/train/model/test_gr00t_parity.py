"""GR00T N1.6 against Isaac-GR00T's own outputs (../shared/fixtures/gr00t_n1d6, computed by the
reference's code at a reduced size with random weights): the reduced model loaded from the
reference's config.json + model.safetensors through the product's loader reproduces every
intermediate output from the reference's processor inputs, and the parameter tables of the
reduced and of the full released architecture are the reference's, name for name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loongforge.train.ckpt.gr00t import load_gr00t_weights
from loongforge.shared.errors import ConfigError
from loongforge.train.model.config import GrootConfig, from_gr00t_json, read_gr00t_dir_config, to_gr00t_json
from loongforge.train.model.model import Gr00tN1d6
from tests.outside import copy_fixture

TOL = 1e-5


def _tsv(path):
    rows = [line.rstrip("\n").split("\t") for line in open(path) if not line.startswith("#")]
    total = next(int(line.split("\t")[1]) for line in open(path) if line.startswith("# TOTAL"))
    return {r[0]: (tuple(json.loads(r[1])), r[2]) for r in rows}, total


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    d = copy_fixture("gr00t_n1d6", tmp_path_factory.mktemp("ref") / "gr00t_n1d6")
    cfg = from_gr00t_json(json.loads((d / "config.json").read_text()),
                          json.loads((d / "eagle_config_reduced.json").read_text()))
    torch.manual_seed(12345)
    model = Gr00tN1d6(cfg, attention="sdpa")
    load_gr00t_weights(model, str(d))
    model.eval()
    inputs = {k: torch.from_numpy(v) for k, v in np.load(d / "inputs.npz").items() if v.dtype.kind != "U"}
    outputs = {k: torch.from_numpy(np.asarray(v)) for k, v in np.load(d / "outputs.npz").items()}
    return d, model, inputs, outputs


def _close(got, want, name):
    err = float((got.float() - want.float()).abs().max())
    assert err <= TOL, f"{name}: max |diff| {err:.3g} > {TOL}"


def test_every_reference_output_within_1e_5(ref):
    _, model, i, o = ref
    inp = {k: i[k] for k in ("pixel_values", "input_ids", "attention_mask", "state", "action", "action_mask",
                             "embodiment_id")}
    with torch.no_grad():
        eagle = model.backbone.model
        _close(eagle.image_embeds(inp["pixel_values"]), o["vit_embeds"][0], "vit_embeds")
        bb = model.backbone(inp["pixel_values"], inp["input_ids"], inp["attention_mask"])
        assert torch.equal(bb["backbone_attention_mask"], o["backbone_attention_mask"])
        assert torch.equal(bb["image_mask"], o["image_mask"])
        valid = o["backbone_attention_mask"]  # padding positions depend on the kernel (fixture README)
        _close(bb["backbone_features"][valid], o["backbone_features_raw"][valid], "backbone_features_raw")
        cond = model.action_head.condition(bb, inp["state"], inp["embodiment_id"])
        _close(cond["features"][valid], o["backbone_features"][valid], "backbone_features")
        _close(cond["state_features"], o["state_features"], "state_features")
        t = i["t"]
        head = model.action_head
        xt = (1 - t[:, None, None]) * i["noise"] + t[:, None, None] * inp["action"]
        _close(head.action_encoder(xt, head.bucket(t), inp["embodiment_id"]), o["action_encoder_out"],
               "action_encoder_out")
        out = head.loss(cond, inp["action"], inp["action_mask"], i["noise"], t)
        _close(out["pred_velocity"], o["pred_velocity"], "pred_velocity")
        _close(out["action_loss"], o["action_loss"], "action_loss")
        _close(out["loss"], o["loss"], "loss")
        _close(inp["action"] - i["noise"], o["target_velocity"], "target_velocity")
        _close(model.get_action(inp, i["init_noise"]), o["action_pred"], "action_pred (4 Euler steps)")
        x = i["init_noise"]
        for step in range(4):
            v = head.velocity(cond, x, torch.full((2,), step * 250))
            _close(v, o["get_action_step_velocities"][step], f"step {step} velocity")
            x = x + 0.25 * v


def test_dit_output(ref):
    _, model, i, o = ref
    head = model.action_head
    seen = {}
    handle = head.model.register_forward_hook(lambda m, a, out: seen.setdefault("dit", out))
    try:
        with torch.no_grad():
            inp = {k: i[k] for k in ("pixel_values", "input_ids", "attention_mask", "state", "action",
                                     "action_mask", "embodiment_id")}
            cond = model.encode(inp)
            head.loss(cond, inp["action"], inp["action_mask"], i["noise"], i["t"])
    finally:
        handle.remove()
    _close(seen["dit"], o["dit_out"], "dit_out")


def test_forward_loss_matches_with_the_flow_time_of_u(ref):
    """The training entry point: t from the caller's uniform u by Beta(1.5, 1)'s inverse CDF. With
    u chosen so that t is the fixture's, the loss is the reference's."""
    _, model, i, o = ref
    t = i["t"].double()
    u = (1.0 - t / 0.999) ** 1.5  # s = 1 - t / noise_s; u = s ** alpha
    inp = {k: i[k] for k in ("pixel_values", "input_ids", "attention_mask", "state", "action", "action_mask",
                             "embodiment_id")}
    with torch.no_grad():
        out = model(inp, i["noise"], u.float())
    assert abs(float(out["loss"]) - float(o["loss"])) < 1e-4


def test_reduced_parameter_table(ref):
    d, model, _, _ = ref
    want, total = _tsv(d / "params_reduced.tsv")
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    assert {n: s for n, s in got.items()} == {n: s for n, (s, _) in want.items()}
    assert sum(p.numel() for p in model.parameters()) == total == 972848


def test_full_released_architecture_on_meta(ref):
    """GrootConfig() is N1.6 as released: names, shapes, count; and what trains by default is what
    the reference keeps in fp32 (frozen parts in bf16)."""
    d = ref[0]
    want, total = _tsv(d / "params_full.tsv")
    with torch.device("meta"):
        model = Gr00tN1d6(GrootConfig())
    got = {n: (tuple(p.shape), p) for n, p in model.named_parameters()}
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    assert all(got[n][0] == want[n][0] for n in want)
    assert sum(p.numel() for p in model.parameters()) == total == 2_964_610_912
    trainable = {n for n, (_, p) in got.items() if p.requires_grad}
    assert trainable == {n for n, (_, dt) in want.items() if dt == "float32"}


def test_config_json_round_trip(ref):
    d = ref[0]
    reduced = from_gr00t_json(json.loads((d / "config.json").read_text()),
                              json.loads((d / "eagle_config_reduced.json").read_text()))
    assert from_gr00t_json(to_gr00t_json(reduced)) == reduced  # our config.json carries its backbone
    # Isaac-GR00T's config.json alone means the released backbone, which this reduced head does not fit:
    with pytest.raises(ConfigError, match="backbone_embedding_dim"):
        read_gr00t_dir_config(str(d / "config.json"))
