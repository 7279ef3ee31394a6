"""The run's HTML page (`loongforge profile`'s profile.html) in a real headless browser: Debian's chromium
driven through chromedriver's WebDriver HTTP API, the page served from the run dir over loopback HTTP.
It loads without console errors, the chart image is there and not blank, the table has the four phases.
The screenshots it takes are docs/profile-page.png and docs/tensorboard.png (README "Watch a run"):
LOONGFORGE_DOCS_SCREENSHOT=PATH and LOONGFORGE_DOCS_TB_SCREENSHOT=PATH write them there too."""

from __future__ import annotations

import base64
import functools
import re
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from loongforge.train.observe import breakdown
from loongforge.train.observe.chart import write_chart

pytestmark = pytest.mark.slow
PHASES = ["data wait", "communication", "launch/dispatch overhead", "compute"]
# Flags that run Debian's chromium headless as root in a container, with nothing reaching outside the machine.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,860"]


def _install_chromium() -> str | None:
    """Debian's chromium + chromium-driver (CI: root on a fresh Debian machine); the reason when not possible."""
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "chromium and chromedriver are not installed and this is not root on Debian (apt-get install " \
               "chromium chromium-driver)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {out.stderr.strip()[-300:]}"
    return None if shutil.which("chromium") and shutil.which("chromedriver") else "chromium still not found"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Browser:
    """A chromedriver process and one session: the few WebDriver commands the test needs."""

    def __init__(self, profile_dir: str):
        self.port = _free_port()
        self.proc = subprocess.Popen(["chromedriver", f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                if self._call("GET", "/status")["ready"]:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "chromedriver did not start"
            time.sleep(0.1)
        caps = {"browserName": "chrome", "goog:loggingPrefs": {"browser": "ALL"},
                "goog:chromeOptions": {"binary": shutil.which("chromium"),
                                       "args": [*FLAGS, f"--user-data-dir={profile_dir}"]}}
        self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]

    def _call(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["value"]

    def cmd(self, method: str, path: str, body: dict | None = None):
        return self._call(method, f"/session/{self.session}{path}", body)

    def open(self, url: str) -> None:
        self.cmd("POST", "/url", {"url": url})

    def run_async(self, script: str):
        return self.cmd("POST", "/execute/async", {"script": script, "args": []})

    def console(self) -> list[dict]:
        """The console messages since the last call (chromedriver's log endpoint)."""
        return self.cmd("POST", "/se/log", {"type": "browser"})

    def screenshot(self) -> bytes:
        return base64.b64decode(self.cmd("GET", "/screenshot"))

    def close(self) -> None:
        try:
            self.cmd("DELETE", "")
        finally:
            self.proc.terminate()
            self.proc.wait(timeout=10)


# What the page shows, measured in the page: the chart decoded and drawn to a canvas, its pixels counted.
INSPECT = """
const done = arguments[arguments.length - 1];
const img = document.getElementById('chart');
const report = (error) => {
  const out = {error, complete: img.complete, width: img.naturalWidth, height: img.naturalHeight,
               shown: img.getBoundingClientRect().width,
               phases: [...document.querySelectorAll('#breakdown tr td:first-child')].map(td => td.textContent)};
  if (!error && img.naturalWidth) {
    const c = document.createElement('canvas');
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    const ctx = c.getContext('2d');
    ctx.drawImage(img, 0, 0);
    const d = ctx.getImageData(0, 0, c.width, c.height).data;
    let ink = 0, n = 0; const colors = new Set();
    for (let i = 0; i < d.length; i += 4 * 5) {
      n++;
      if (d[i] < 235 || d[i + 1] < 235 || d[i + 2] < 235) ink++;
      colors.add((d[i] >> 3) << 10 | (d[i + 1] >> 3) << 5 | d[i + 2] >> 3);
    }
    out.ink = ink / n; out.colors = colors.size;
  }
  done(out);
};
if (img.complete) report(img.naturalWidth ? null : 'not loaded');
else { img.onload = () => report(null); img.onerror = () => report('not loaded'); }
"""


def _run_dir(path) -> str:
    """A run dir as `loongforge profile` leaves it: metrics.jsonl of 300 steps, profile.png, profile.html."""
    rng = np.random.default_rng(0)
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(300):
            row = {"v": 1, "step": step, "loss": 2.0 / (1 + step / 50) + 0.05 * rng.random(), "samples": 16,
                   "warmup": step == 0, "world": 2, "data_wait_s": 0.004 + 0.01 * (step % 40 == 0),
                   "forward_s": 0.03 + 0.004 * rng.random(), "backward_s": 0.05, "optimizer_s": 0.01,
                   "comm_s": 0.012, "overhead_s": 0.006, "lr": 3e-3 * min(1.0, (step + 1) / 15),
                   "grad_norm": 1.5 / (1 + step / 40) + 0.1 * rng.random()}
            row["step_s"] = sum(row[k] for k in ("data_wait_s", "forward_s", "backward_s", "optimizer_s",
                                                  "overhead_s"))
            row["compute_s"] = row["forward_s"] + row["backward_s"] + row["optimizer_s"] - row["comm_s"]
            if step % 100 == 99:
                row.update(val_flow_loss=1.0 / (1 + step / 80), val_action_mse=0.6 / (1 + step / 80))
            f.write(json.dumps(row) + "\n")
    b = breakdown.breakdown(str(path))
    write_chart(b, str(path))
    breakdown.write_html(b, str(path))
    return str(path)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    why = _install_chromium()
    if why:
        pytest.skip(f"no headless browser: {why}")
    b = Browser(str(tmp_path_factory.mktemp("chromium-profile")))
    yield b
    b.close()


@pytest.fixture
def served(tmp_path):
    """The run dir served over loopback HTTP, as a user's `python -m http.server` would."""
    run_dir = _run_dir(tmp_path / "run")
    handler = functools.partial(_QuietHandler, directory=run_dir)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield run_dir, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test's output stays the test's
        pass


@pytest.mark.timeout(1200)  # a fresh CI machine installs chromium in the fixture first (apt-get: minutes)
def test_profile_page_in_a_real_browser(browser, served, tmp_path):
    run_dir, url = served
    browser.console()  # drop what the new tab logged
    browser.open(f"{url}/profile.html")
    page = browser.run_async(INSPECT)
    errors = [m for m in browser.console() if m["level"] == "SEVERE"]
    assert errors == [], errors
    assert page["error"] is None and page["complete"] and page["shown"] > 0
    assert (page["width"], page["height"]) == (1500, 400)  # chart.py: 15 x 4 inches at 100 dpi
    assert page["ink"] > 0.05 and page["colors"] > 20, page  # a drawn chart: lines, areas, text in several colours
    assert page["phases"] == PHASES
    shot = browser.screenshot()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "profile-page.png").write_bytes(shot)
    if os.environ.get("LOONGFORGE_DOCS_SCREENSHOT"):
        with open(os.environ["LOONGFORGE_DOCS_SCREENSHOT"], "wb") as f:
            f.write(shot)

    # The same checks catch a broken page: the chart missing is a console error and an image not loaded.
    os.remove(os.path.join(run_dir, "profile.png"))
    browser.open(f"{url}/profile.html?again")
    page = browser.run_async(INSPECT)
    errors = [m["message"] for m in browser.console() if m["level"] == "SEVERE"]
    assert page["error"] == "not loaded" and any("profile.png" in e and "404" in e for e in errors), errors


def _tensorboard_server(logdir: str):
    """`tensorboard --logdir LOGDIR` on a loopback port, as a user starts it; (process, url) once it answers."""
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "tensorboard")  # the venv's, beside its python
    proc = subprocess.Popen([exe, "--logdir", logdir, "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=2) as r:
                if json.loads(r.read()):
                    return proc, f"http://127.0.0.1:{port}"
        except (urllib.error.URLError, ConnectionError, ValueError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "tensorboard did not serve the run"
        time.sleep(0.3)


# `full`: a TensorBoard server and its web app (seconds of JavaScript on 2 cores). make test reads the same
# events through TensorBoard's own reader: test_tracking.py::test_sigkill_then_resume_every_step_once_in_tensorboard_and_wandb.
@pytest.mark.full
@pytest.mark.timeout(1200)
def test_tensorboard_shows_a_run_in_a_real_browser(browser, tmp_path):
    """A run's TensorBoard (training steps, then `loongforge profile`'s table and chart) in TensorBoard's own web
    app: the train/, train_time/ and profile/ groups are there, and no console error."""
    from loongforge.train.config import DataConfig, RunConfig, TrackConfig, TrainConfig
    from loongforge.train.observe.metrics import read_metrics
    from loongforge.train.observe.tracking import Tracker, report_profile

    run_dir = _run_dir(tmp_path / "run")
    cfg = TrainConfig(data=DataConfig(root="unused"), run=RunConfig(run_dir=run_dir),
                      track=TrackConfig(report_to=("tensorboard",)))
    tracker = Tracker.for_training(cfg, rank=0, start_step=0)
    for row in read_metrics(run_dir):  # what MetricsLog hands the tracker as it writes each row
        tracker.log_step(row)
    tracker.close()
    b = breakdown.breakdown(run_dir)
    report_profile(run_dir, b, write_chart(b, run_dir))
    server, url = _tensorboard_server(os.path.join(run_dir, "tensorboard"))
    try:
        browser.console()
        browser.open(f"{url}/#timeseries")
        deadline = time.monotonic() + 90
        while True:
            text = browser.cmd("POST", "/execute/sync", {"script": "return document.body.innerText", "args": []})
            groups = set(re.findall(r"(?m)^([a-z_]+)\d+ cards?$", text))  # a group's header: "train_time17 cards"
            if {"train", "train_time", "profile"} <= groups and "profile\n/chart" in text:  # the first card is shown
                break
            assert time.monotonic() < deadline, text[:2000]
            time.sleep(0.5)
        errors = [m for m in browser.console() if m["level"] == "SEVERE"]
        assert errors == [], errors
        # The screenshot: the training curves, in TensorBoard's scalars dashboard filtered to train/.
        browser.open(f"{url}/#scalars&tagFilter=train%2F(loss%7Clr%7Cgrad_norm)&_smoothingWeight=0")
        deadline = time.monotonic() + 60
        while browser.cmd("POST", "/execute/sync", {"script": "return document.querySelectorAll("
                                                                "'tf-scalar-card, .tf-scalar-card, svg').length",
                                                      "args": []}) < 3:
            assert time.monotonic() < deadline, "no scalar charts"
            time.sleep(0.5)
        time.sleep(2)  # the charts' first draw
        shot = browser.screenshot()
        (tmp_path / "tensorboard.png").write_bytes(shot)
        if os.environ.get("LOONGFORGE_DOCS_TB_SCREENSHOT"):
            with open(os.environ["LOONGFORGE_DOCS_TB_SCREENSHOT"], "wb") as f:
                f.write(shot)
    finally:
        server.terminate()
        server.wait(timeout=10)
