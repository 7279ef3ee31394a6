"""Relative <-> absolute actions, as GR00T N1.6 defines them (Isaac-GR00T's state_action/pose.py):

  NON_EEF (joints)   relative = a_k - s_t                   absolute = s_t + r_k
  EEF                relative = T(s_t)^-1 . T(a_k)          absolute = T(s_t) . T(r_k)

with T a 4x4 rigid transform read from the key's format: XYZ_ROT6D (xyz + the first two ROWS of R,
Gram-Schmidt normalised, third row their cross product), XYZ_ROTVEC (xyz + axis-angle) or DEFAULT
(the 16 values of T, row-major). s_t is the raw state of the reference key at the current frame.
Everything is vectorised over leading dimensions and computed in float64 (the reference's scipy
rotations are float64, through quaternions): `to_relative(action (..., H, D), ref (..., D), type, format)`.
"""

from __future__ import annotations

import numpy as np

from loongforge.shared.errors import ConfigError

EEF_DIMS = {"XYZ_ROT6D": 9, "XYZ_ROTVEC": 6, "DEFAULT": 16}


def _rot6d_to_matrix(r6: np.ndarray) -> np.ndarray:
    """Gram-Schmidt of the two rows, in the input's own precision (the reference's float32 state gives a
    float32 basis), the third row their cross product."""
    a, b = r6[..., 0:3], r6[..., 3:6]
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b - np.sum(a * b, axis=-1, keepdims=True) * a
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return np.stack([a, b, np.cross(a, b)], axis=-2)  # rows


def matrix_to_quat(r: np.ndarray) -> np.ndarray:
    """(..., 3, 3) -> unit quaternions (..., 4) as (x, y, z, w) as scipy's Rotation.from_matrix (which the
    reference goes through) makes them: the nearest orthogonal matrix first (U V^T of the SVD: a float32
    Gram-Schmidt basis is orthogonal only to ~1e-7), then Markley's method (the largest of the diagonal
    and the trace picks the branch)."""
    u, _, vt = np.linalg.svd(np.asarray(r, np.float64))
    r = u @ vt
    neg = np.linalg.det(r) < 0  # a reflection: not a rotation; flip the last singular direction
    if neg.any():
        u[neg, :, -1] *= -1
        r = u @ vt
    tr = r[..., 0, 0] + r[..., 1, 1] + r[..., 2, 2]
    decision = np.stack([r[..., 0, 0], r[..., 1, 1], r[..., 2, 2], tr], axis=-1)
    choice = np.argmax(decision, axis=-1)
    q = np.empty(r.shape[:-2] + (4,))
    for i in range(3):
        j, k = (i + 1) % 3, (i + 2) % 3
        sel = choice == i
        q[sel, i] = (1 - tr + 2 * r[..., i, i])[sel]
        q[sel, j] = (r[..., j, i] + r[..., i, j])[sel]
        q[sel, k] = (r[..., k, i] + r[..., i, k])[sel]
        q[sel, 3] = (r[..., k, j] - r[..., j, k])[sel]
    sel = choice == 3
    q[sel, 0] = (r[..., 2, 1] - r[..., 1, 2])[sel]
    q[sel, 1] = (r[..., 0, 2] - r[..., 2, 0])[sel]
    q[sel, 2] = (r[..., 1, 0] - r[..., 0, 1])[sel]
    q[sel, 3] = (1 + tr)[sel]
    return q / np.linalg.norm(q, axis=-1, keepdims=True)


def quat_to_matrix(q: np.ndarray) -> np.ndarray:
    x, y, z, w = q[..., 0], q[..., 1], q[..., 2], q[..., 3]
    x2, y2, z2, w2 = x * x, y * y, z * z, w * w
    xy, zw, xz, yw, yz, xw = x * y, z * w, x * z, y * w, y * z, x * w
    m = np.empty(q.shape[:-1] + (3, 3))
    m[..., 0, 0], m[..., 1, 0], m[..., 2, 0] = x2 - y2 - z2 + w2, 2 * (xy + zw), 2 * (xz - yw)
    m[..., 0, 1], m[..., 1, 1], m[..., 2, 1] = 2 * (xy - zw), -x2 + y2 - z2 + w2, 2 * (yz + xw)
    m[..., 0, 2], m[..., 1, 2], m[..., 2, 2] = 2 * (xz + yw), 2 * (yz - xw), -x2 - y2 + z2 + w2
    return m


def _rotvec_to_quat(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, np.float64)
    angle = np.linalg.norm(v, axis=-1)
    small = angle <= 1e-3  # Taylor series of sin(a/2)/a near 0, as scipy's from_rotvec
    a2 = angle * angle
    scale = np.where(small, 0.5 - a2 / 48 + a2 * a2 / 3840, np.sin(angle / 2) / np.where(small, 1.0, angle))
    return np.concatenate([v * scale[..., None], np.cos(angle / 2)[..., None]], axis=-1)


def _quat_to_rotvec(q: np.ndarray) -> np.ndarray:
    q = np.where(q[..., 3:4] < 0, -q, q)  # w >= 0: the angle in [0, pi]
    angle = 2 * np.arctan2(np.linalg.norm(q[..., :3], axis=-1), q[..., 3])
    small = angle <= 1e-3
    a2 = angle * angle
    scale = np.where(small, 2 + a2 / 12 + 7 * a2 * a2 / 2880, angle / np.sin(np.where(small, 1.0, angle) / 2))
    return q[..., :3] * scale[..., None]


def to_transform(x: np.ndarray, fmt: str) -> np.ndarray:
    """(..., D) pose values in `fmt` -> (..., 4, 4) float64 transforms, the rotation through its quaternion
    (as the reference's scipy Rotation holds it)."""
    x = np.asarray(x)
    if x.shape[-1] != EEF_DIMS[fmt]:
        raise ConfigError(f"EEF format {fmt} has {EEF_DIMS[fmt]} values, got {x.shape[-1]}")
    if fmt == "DEFAULT":
        x = x.reshape(x.shape[:-1] + (4, 4))
        rot = quat_to_matrix(matrix_to_quat(x[..., :3, :3]))
        trans = x[..., :3, 3]
    else:
        quat = matrix_to_quat(_rot6d_to_matrix(x[..., 3:9])) if fmt == "XYZ_ROT6D" else _rotvec_to_quat(x[..., 3:6])
        rot, trans = quat_to_matrix(quat), x[..., :3]
    t = np.zeros(x.shape[:-1] + (4, 4) if fmt != "DEFAULT" else x.shape)
    t[..., :3, :3] = rot
    t[..., :3, 3] = trans
    t[..., 3, 3] = 1.0
    return t


def from_transform(t: np.ndarray, fmt: str) -> np.ndarray:
    quat = matrix_to_quat(t[..., :3, :3])
    if fmt == "DEFAULT":
        out = np.array(t, np.float64)
        out[..., :3, :3] = quat_to_matrix(quat)
        return out.reshape(t.shape[:-2] + (16,))
    tail = quat_to_matrix(quat)[..., :2, :].reshape(t.shape[:-2] + (6,)) if fmt == "XYZ_ROT6D" \
        else _quat_to_rotvec(quat)
    return np.concatenate([t[..., :3, 3], tail], axis=-1)


def _invert(t: np.ndarray) -> np.ndarray:
    out = np.zeros_like(t)
    rt = np.swapaxes(t[..., :3, :3], -1, -2)
    out[..., :3, :3] = rt
    out[..., :3, 3] = -(rt @ t[..., :3, 3:4])[..., 0]
    out[..., 3, 3] = 1.0
    return out


def to_relative(action: np.ndarray, ref: np.ndarray, kind: str, fmt: str) -> np.ndarray:
    """Absolute action chunk (..., H, D) against the reference state (..., D) -> relative (float64).
    EEF poses are read in their own precision (a float32 rot6d is orthonormalised in float32, as the
    reference does), then transformed in float64."""
    action, ref = np.asarray(action), np.asarray(ref)
    if action.shape[-1] != ref.shape[-1]:
        raise ConfigError(f"relative action of {action.shape[-1]} values against a state of {ref.shape[-1]}")
    if kind == "NON_EEF":
        return action.astype(np.float64) - ref.astype(np.float64)[..., None, :]
    inv = _invert(to_transform(ref, fmt))[..., None, :, :]
    return from_transform(inv @ to_transform(action, fmt), fmt)


def to_absolute(relative: np.ndarray, ref: np.ndarray, kind: str, fmt: str) -> np.ndarray:
    """Relative action chunk (..., H, D) on top of the reference state (..., D) -> absolute (float64)."""
    relative, ref = np.asarray(relative), np.asarray(ref)
    if relative.shape[-1] != ref.shape[-1]:
        raise ConfigError(f"relative action of {relative.shape[-1]} values against a state of {ref.shape[-1]}")
    if kind == "NON_EEF":
        return relative.astype(np.float64) + ref.astype(np.float64)[..., None, :]
    return from_transform(to_transform(ref, fmt)[..., None, :, :] @ to_transform(relative, fmt), fmt)
