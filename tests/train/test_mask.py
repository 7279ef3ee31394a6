import torch

from loongforge.train.mask import build_mask, prefix_valid


def dense_reference(frame_mask, task_mask, cameras, patches, n_action):
    """The rules written as loops, token by token, independent of mask.py."""
    b, k = frame_mask.shape
    L = task_mask.shape[1]
    kinds, valid = [], []
    for i in range(b):
        row_kind, row_valid = [], []
        for _c in range(cameras):
            for f in range(k):
                for _p in range(patches):
                    row_kind.append("prefix")
                    row_valid.append(bool(frame_mask[i, f]))
        for f in range(k):
            row_kind.append("prefix")
            row_valid.append(bool(frame_mask[i, f]))
        for t in range(L):
            row_kind.append("prefix")
            row_valid.append(bool(task_mask[i, t]))
        for _a in range(n_action):
            row_kind.append("action")
            row_valid.append(True)
        kinds.append(row_kind)
        valid.append(row_valid)
    n = len(kinds[0])
    out = torch.zeros(b, 1, n, n, dtype=torch.bool)
    for i in range(b):
        for q in range(n):
            for kk in range(n):
                if not valid[i][q]:
                    ok = q == kk
                elif kinds[i][q] == "prefix":
                    ok = kinds[i][kk] == "prefix" and valid[i][kk]
                else:
                    ok = valid[i][kk] and (kinds[i][kk] == "prefix" or kk <= q)
                out[i, 0, q, kk] = ok
    return out


def test_mask_equals_loop_reference():
    frame_mask = torch.tensor([[True, True, False], [True, False, False]])
    task_mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    cams, patches, h = 2, 3, 4
    got = build_mask(prefix_valid(frame_mask, task_mask, cameras=cams, patches=patches), h)
    want = dense_reference(frame_mask, task_mask, cams, patches, h)
    assert got.shape == want.shape
    assert torch.equal(got, want)


def test_no_nan_rows_with_sdpa():
    frame_mask = torch.tensor([[True, False]])
    task_mask = torch.tensor([[True, False]])
    mask = build_mask(prefix_valid(frame_mask, task_mask, cameras=1, patches=2), 3)
    n = mask.shape[-1]
    q = torch.randn(1, 2, n, 8)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert torch.isfinite(out).all()
    assert mask.any(-1).all()  # every query attends to at least one key
