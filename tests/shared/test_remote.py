"""Shard roots served over HTTP (fsspec), as an object store would serve them."""

import functools
import http.server
import os
import threading

import pytest

import numpy as np

from loongforge.shared.dataset import open_root


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with single-range support (object stores all honour Range)."""

    honour_range = True

    def log_message(self, *args):
        pass

    def do_GET(self):
        rng = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not rng or not self.honour_range or not os.path.isfile(path):
            return super().do_GET()
        start, _, end = rng.removeprefix("bytes=").partition("-")
        data = open(path, "rb").read()
        start = int(start)
        end = min(int(end) if end else len(data) - 1, len(data) - 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self.wfile.write(data[start : end + 1])


@pytest.fixture(params=[True, False], ids=["range", "no-range"])
def http_root(request, synthetic_root):
    root, index = synthetic_root
    handler = type("H", (RangeHandler,), {"honour_range": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=root))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root, index
    server.shutdown()


def test_http_origin_matches_local(http_root):
    url, root, index = http_root
    remote, local = open_root(url), open_root(root)
    assert remote.verify() == [] and remote.shard_index == local.shard_index == index
    for n in (0, 5, 61, local.num_frames - 1):  # blocks by byte range (or whole objects), checksums verified
        e, t = remote.locate(n)
        assert (e, t) == local.locate(n)
        b, _ = remote.block_of(t)
        np.testing.assert_array_equal(remote.read_block(e, "front", b), local.read_block(e, "front", b))
        np.testing.assert_array_equal(remote.read_arrays(e)["state"], local.read_arrays(e)["state"])


def test_unreachable_http_origin_is_a_storage_error_naming_the_url():
    from tests.conftest import free_port

    from loongforge.shared import storage
    from loongforge.shared.errors import FormatError, StorageError

    url = f"http://127.0.0.1:{free_port()}/shards"  # nothing listens there
    with pytest.raises(StorageError, match=r"could not read http://127\.0\.0\.1:\d+/shards/index\.json"):
        storage.read_bytes(url + "/index.json")
    with pytest.raises(StorageError) as info:
        open_root(url)
    assert not isinstance(info.value, FormatError)  # unreachable, not "not a shard root"
