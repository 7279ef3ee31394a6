"""The TP module swap keeps what trains: a frozen linear's shards stay frozen (a fine-tune's frozen
LLM under --tp, the vision pooling head N1.6 never calls), a trained one's train."""

from __future__ import annotations

import torch

from loongforge.train.model.build import build_model
from loongforge.train.parallel.tensor_parallel import TP_PLAN, _swap, tp_modules
from loongforge.train.recipes import recipe


def test_swapped_shards_keep_requires_grad():
    cfg = recipe("tiny").model.replace(tune_llm=False, tune_top_llm_layers=1)
    torch.manual_seed(0)
    model = build_model(cfg)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    assert not all(before.values()) and any(before.values())
    for _, mod in tp_modules(model):
        for path, kind in TP_PLAN[type(mod).__name__]:
            _swap(mod, path, kind, rank=0, world=2, group=None)  # no collective runs at construction
    after = {n: p.requires_grad for n, p in model.named_parameters()}
    assert after == before
