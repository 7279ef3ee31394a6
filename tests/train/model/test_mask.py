import torch

from loongforge.train.model.mask import (causal_mask, cross_mask, key_valid, vl_segments, vl_self_mask,
                                   vl_valid_lengths)


def reference_valid(frame_mask, task_mask, cameras, tokens):
    """Token validity written as loops over the documented layout, independent of mask.py."""
    b, k = frame_mask.shape
    rows = []
    for i in range(b):
        row = []
        for _c in range(cameras):
            for f in range(k):
                row += [bool(frame_mask[i, f])] * tokens
        row += [bool(frame_mask[i, f]) for f in range(k)]
        row += [bool(v) for v in task_mask[i]]
        rows.append(row)
    return torch.tensor(rows)


def test_segments_give_the_token_validity_and_masks():
    frame_mask = torch.tensor([[True, True, False], [True, False, False]])
    task_mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    cams, tokens = 2, 3
    segs = vl_segments(cameras=cams, frames=3, tokens_per_frame=tokens, text_len=4)
    assert [s.length for s in segs] == [9, 9, 3, 4]
    lengths = vl_valid_lengths(frame_mask, task_mask, cameras=cams, tokens_per_frame=tokens)
    assert lengths.tolist() == [[6, 6, 2, 3], [3, 3, 1, 1]]  # the varlen table: no N x N tensor
    valid = key_valid(segs, lengths)
    want = reference_valid(frame_mask, task_mask, cams, tokens)
    assert torch.equal(valid, want)
    m = vl_self_mask(valid)
    n = valid.shape[1]
    for i in range(2):
        for q in range(n):
            expect = want[i] if want[i, q] else torch.nn.functional.one_hot(torch.tensor(q), n).bool()
            assert torch.equal(m[i, 0, q], expect)
    assert torch.equal(cross_mask(valid)[:, 0, 0], want)


def test_no_nan_rows_with_sdpa():
    valid = torch.tensor([[True, False, False], [False, False, False]])  # second: a bad sample
    for mask, nq in ((vl_self_mask(valid), 3), (cross_mask(valid), 5)):
        q = torch.randn(2, 2, nq, 8)
        kv = torch.randn(2, 2, 3, 8)
        out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
        assert torch.isfinite(out).all()
        assert mask.any(-1).all()


def test_causal_mask():
    m = causal_mask(4, "cpu")
    assert m[2].tolist() == [True, True, True, False]
    assert m.sum() == 10
