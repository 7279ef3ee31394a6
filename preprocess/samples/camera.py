"""Camera model for synthetic robot footage (`loongforge sample-data OUT --footage camera`).

The default sample footage (`footage="grain"`, samples/dataset.py) scrolls a noise
texture across the whole frame: every pixel changes every frame, which H.264
encodes by motion compensation at ~1.5 KB a frame but which no lossless coder
can model. That is a worst case for storing decoded frames, not what a robot
camera sees. This module renders what a fixed robot camera sees instead, so
that storage benchmarks of decoded NV12 (FORMAT.md) have a realistic row.

What it models (per episode and camera, deterministic from `seed`):
  * a static scene with the detail a bench or kitchen has: a tiled back wall
    (per-tile shade, darker grout lines, vertical light gradient), a cabinet
    with a frame and a handle, a wooden table top (low-frequency grain and
    blotches) with a dark far edge, three small static boxes and a bowl;
  * a two-link articulated arm entering from the bottom of the frame, drawn
    as shaded capsules (cylinder shading across each link, anti-aliased
    edges) with a two-finger gripper that opens and closes, its joint angles
    following smooth sums of sinusoids at 0.04-0.2 Hz (JOINT_CYCLES at
    20 fps: a reach takes seconds; measured over seeds 0-3, the wrist moves
    a median 2-5 px a frame (max ~8) at 256x256, i.e. ~0.1-0.2 m/s if the
    view spans ~1 m: teleoperated pick-and-place speed);
  * a cube sliding on the table along a slower smooth path, with a soft
    contact shadow;
  * slow global illumination change (gain +-3 % over 12-20 s, plus a slow
    colour-temperature drift of +-1.5 %);
  * temporally independent Gaussian sensor noise at `noise` DN (8-bit
    levels, default 1.5, per channel), added BEFORE H.264 encoding, as a
    real sensor's read + shot noise is; x264 at CRF 23 smooths much of it
    in static areas (skip blocks copy the reference), as it does on real
    footage. `noise=0` is a simulator render (the GR00T demo data,
    robot_sim.*, is simulator footage).

What it does not model: camera ego-motion (GR00T's GR1 ego view is
head-mounted and moves a little with the waist), motion blur, rolling
shutter, lens distortion and vignetting, auto-exposure / white-balance
hunting, specular highlights, real textures' fine high-frequency detail
(cloth, printed labels, cables), occlusion-dependent lighting, a
person in the scene, and the source camera's own compression (real robot
frames are often already JPEG/H.264 before LeRobot re-encodes them). So it
is a plausible middle ground between the grain worst case and a perfectly
clean render, not a substitute for measuring real GR00T footage.

Rendering is vectorised per frame over bounding boxes (no per-pixel Python):
a 256x256 frame takes ~6 ms of CPU, about what x264 (veryfast) takes to encode it.
"""

from __future__ import annotations

import numpy as np

NOISE_DN = 1.5  # sensor noise sigma in 8-bit levels: a well-lit industrial/webcam sensor
ILLUMINATION = 0.03  # relative amplitude of the slow global gain change
# Joint oscillation, cycles per frame: 0.04-0.2 Hz at 20 fps, i.e. a reach takes 2.5-12 s
# (teleoperated pick-and-place speed, not a waving arm).
JOINT_CYCLES = (0.002, 0.01)


def _smooth_noise(h: int, w: int, cells: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """(h, w) float32 in about [-1, 1]: coarse random grid, bilinear upsampled (no blocky edges)."""
    gy, gx = cells
    coarse = rng.uniform(-1, 1, size=(gy + 2, gx + 2)).astype(np.float32)
    ys = np.linspace(0, gy, h, dtype=np.float32)
    xs = np.linspace(0, gx, w, dtype=np.float32)
    y0, x0 = ys.astype(int), xs.astype(int)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    # smoothstep weights: continuous slope across cells
    fy, fx = fy * fy * (3 - 2 * fy), fx * fx * (3 - 2 * fx)
    a, b = coarse[y0][:, x0], coarse[y0][:, x0 + 1]
    c, d = coarse[y0 + 1][:, x0], coarse[y0 + 1][:, x0 + 1]
    return (a * (1 - fx) + b * fx) * (1 - fy) + (c * (1 - fx) + d * fx) * fy


def _background(h: int, w: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """(h, w, 3) float32 static scene and the table-top row: a tiled wall with a cabinet,
    a wooden table top, a bowl and a few static objects (the detail a kitchen or lab bench has)."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    horizon = int(h * rng.uniform(0.3, 0.42))
    wall_rgb = np.array(rng.uniform([160, 160, 150], [205, 200, 195]), np.float32)
    tile = max(6, h // 10)
    tiles = rng.uniform(-6, 6, size=(h // tile + 1, w // tile + 1)).astype(np.float32)
    tile_shade = tiles[yy.astype(int) // tile, xx.astype(int) // tile][..., None]
    wall = wall_rgb * (1.05 - 0.25 * yy[..., None] / h) + tile_shade
    grout = ((yy % tile) < 1.5) | ((xx % tile) < 1.5)
    wall = np.where(grout[..., None], wall * 0.8, wall) + 4 * _smooth_noise(h, w, (3, 4), rng)[..., None]
    # a cabinet on one side of the wall: a darker panel with a frame and a handle
    c0, c1 = int(w * rng.uniform(0.0, 0.1)), int(w * rng.uniform(0.3, 0.45))
    cab_rgb = np.array(rng.uniform([90, 60, 40], [140, 110, 90]), np.float32)
    wall[: horizon, c0:c1] = cab_rgb * (0.9 + 0.1 * _smooth_noise(horizon, c1 - c0, (2, 2), rng))[..., None]
    wall[: horizon, c0:c0 + 2] *= 0.6
    wall[: horizon, c1 - 2:c1] *= 0.6
    wall[int(horizon * 0.45):int(horizon * 0.6), c1 - 8:c1 - 5] = (200, 200, 205)
    wood_rgb = np.array(rng.uniform([120, 80, 45], [170, 120, 80]), np.float32)
    grain = np.sin(xx / w * rng.uniform(30, 50) * np.pi + 4 * _smooth_noise(h, w, (3, 4), rng)) * 7
    blotch = 10 * _smooth_noise(h, w, (4, 6), rng)
    table = wood_rgb * (0.85 + 0.25 * (yy[..., None] - horizon) / h) + (grain + blotch)[..., None]
    bg = np.where((yy < horizon)[..., None], wall, table)
    bg[max(0, horizon - 2): horizon + 2] *= 0.6  # the table's far edge: a dark line
    for k in range(3):  # static clutter near the back of the table: small boxes
        oy = horizon + (h - horizon) * rng.uniform(0.05, 0.3)
        ox = w * rng.uniform(0.05, 0.95)
        _cube(bg, oy, ox, h * rng.uniform(0.025, 0.045), np.array(rng.uniform(30, 230, 3), np.float32))
    # a static bowl: shaded ellipse on the table
    cy, cx = horizon + (h - horizon) * rng.uniform(0.3, 0.6), w * rng.uniform(0.65, 0.85)
    ry, rx = h * 0.07, w * 0.11
    r2 = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2
    bowl_rgb = np.array(rng.uniform([40, 80, 150], [80, 140, 210]), np.float32)
    shade = (0.65 + 0.35 * np.sqrt(np.clip(1 - r2, 0, 1)))[..., None]
    alpha = np.clip((1 - r2) * rx, 0, 1)[..., None]
    bg = bg * (1 - alpha) + bowl_rgb * shade * alpha
    return bg.astype(np.float32), horizon


def _capsule(img: np.ndarray, p0, p1, radius: float, rgb: np.ndarray) -> None:
    """Draw a shaded capsule (cylinder shading across it) in place, inside its bounding box."""
    h, w, _ = img.shape
    lo = np.floor(np.minimum(p0, p1) - radius - 1).astype(int)
    hi = np.ceil(np.maximum(p0, p1) + radius + 2).astype(int)
    y0, x0 = max(lo[0], 0), max(lo[1], 0)
    y1, x1 = min(hi[0], h), min(hi[1], w)
    if y0 >= y1 or x0 >= x1:
        return
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)
    d = np.asarray(p1, np.float32) - np.asarray(p0, np.float32)
    t = np.clip(((yy - p0[0]) * d[0] + (xx - p0[1]) * d[1]) / max(float(d @ d), 1e-6), 0, 1)
    dist = np.hypot(yy - (p0[0] + t * d[0]), xx - (p0[1] + t * d[1]))
    u = np.clip(dist / radius, 0, 1)
    shade = (0.45 + 0.55 * np.sqrt(1 - u * u))[..., None]
    alpha = np.clip(radius - dist + 0.5, 0, 1)[..., None]
    box = img[y0:y1, x0:x1]
    box *= 1 - alpha
    box += alpha * shade * rgb


def _cube(img: np.ndarray, cy: float, cx: float, half: float, rgb: np.ndarray) -> None:
    """A soft contact shadow, then a cube seen from above-front: lit top face, darker front face."""
    h, w, _ = img.shape
    y0, y1 = max(int(cy - 2 * half), 0), min(int(cy + 2 * half) + 2, h)
    x0, x1 = max(int(cx - 2 * half), 0), min(int(cx + 2 * half) + 2, w)
    if y0 >= y1 or x0 >= x1:
        return
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)
    box = img[y0:y1, x0:x1]
    shadow = np.exp(-(((yy - cy - 0.6 * half) / (1.3 * half)) ** 2 + ((xx - cx) / (1.5 * half)) ** 2))
    box *= (1 - 0.35 * shadow)[..., None]
    dy, dx = np.abs(yy - cy), np.abs(xx - cx)
    alpha = np.clip(half - np.maximum(dy, dx) + 0.5, 0, 1)[..., None]
    face = np.where(yy < cy - 0.2 * half, 1.0, 0.7)[..., None]  # top face lit, front face darker
    box *= 1 - alpha
    box += alpha * face * rgb


def _smooth_path(n: int, rng: np.random.Generator, dims: int, freqs: tuple[float, float]) -> np.ndarray:
    """(n, dims) in about [-1, 1]: a sum of three sinusoids per dimension (smooth, no jumps)."""
    t = np.arange(n, dtype=np.float32)[:, None, None]
    f = rng.uniform(*freqs, size=(1, dims, 3)).astype(np.float32)
    ph = rng.uniform(0, 2 * np.pi, size=(1, dims, 3)).astype(np.float32)
    amp = np.array([0.6, 0.3, 0.1], np.float32)
    return (np.sin(2 * np.pi * f * t + ph) * amp).sum(axis=2)


def camera_frames(n: int, height: int, width: int, seed: int, *, noise: float = NOISE_DN,
                  illumination: float = ILLUMINATION) -> np.ndarray:
    """(n, h, w, 3) uint8 RGB of a fixed camera watching an arm and a cube on a table.
    A pure function of its arguments."""
    rng = np.random.default_rng(seed)
    bg, horizon = _background(height, width, rng)
    # joint angles: shoulder swings +-35 deg around pointing up-inwards, elbow +-40 deg
    joints = _smooth_path(n, rng, 3, JOINT_CYCLES)
    cube_path = _smooth_path(n, rng, 2, (0.001, 0.005))
    base = np.array([height * 1.08, width * rng.uniform(0.3, 0.5)], np.float32)
    l1, l2 = 0.5 * height, 0.38 * height
    arm_rgb = np.array(rng.uniform([170, 170, 170], [215, 215, 220]), np.float32)
    grip_rgb = np.array([45, 45, 50], np.float32)
    cube_rgb = np.array(rng.uniform([170, 20, 20], [230, 70, 60]), np.float32)
    gain = 1 + illumination * np.sin(2 * np.pi * np.arange(n) / rng.uniform(250, 400) + rng.uniform(0, 2 * np.pi))
    tint = illumination / 2 * np.sin(2 * np.pi * np.arange(n) / rng.uniform(400, 700) + rng.uniform(0, 2 * np.pi))
    out = np.empty((n, height, width, 3), np.uint8)
    frame = np.empty_like(bg)
    for i in range(n):  # per-frame (not per-pixel) loop: every draw is vectorised over its bounding box
        np.copyto(frame, bg)
        cy = horizon + (height - horizon) * (0.55 + 0.3 * cube_path[i, 0])
        cx = width * (0.45 + 0.3 * cube_path[i, 1])
        _cube(frame, cy, cx, 0.05 * height, cube_rgb)
        a1 = -np.pi / 2 + 0.6 * joints[i, 0]
        a2 = a1 + 0.9 + 0.7 * joints[i, 1]
        elbow = base + l1 * np.array([np.sin(a1), np.cos(a1)], np.float32)
        wrist = elbow + l2 * np.array([np.sin(a2), np.cos(a2)], np.float32)
        _capsule(frame, base, elbow, 0.075 * width, arm_rgb)
        _capsule(frame, elbow, wrist, 0.055 * width, arm_rgb)
        opening = 0.03 * width * (1.3 + joints[i, 2])
        side = np.array([-np.cos(a2), np.sin(a2)], np.float32) * opening
        tip = wrist + 0.08 * height * np.array([np.sin(a2), np.cos(a2)], np.float32)
        for s in (side, -side):  # two gripper fingers
            _capsule(frame, wrist + s, tip + s, 0.018 * width, grip_rgb)
        frame *= np.array([gain[i] * (1 + tint[i]), gain[i], gain[i] * (1 - tint[i])], np.float32)
        if noise > 0:
            frame += rng.normal(0, noise, size=frame.shape).astype(np.float32)
        np.clip(frame, 0, 255, out=frame)
        out[i] = np.rint(frame)
    return out
