"""curl downloading a large file from python3 -m http.server, both under the layer."""

import pytest

from helpers import (H1, H1_IP, PLACES, PYTHON, Watcher, assert_virtual, place, sha256_file,
                     write_random_file)

FILE_SIZE = 64 << 20


@pytest.mark.parametrize("where", list(PLACES))
def test_curl_http_server(procs, workdir, where):
    host, env, substrate, port = place(where, "http")
    served = workdir / "www"
    served.mkdir()
    digest = write_random_file(served / "file", FILE_SIZE)
    out = workdir / "download"
    procs.server(H1, [PYTHON, "-m", "http.server", port, "--bind", H1_IP, "--directory",
                      served], port, layer=True, name="http-server", env=env)
    with Watcher(H1, host) as w:
        # The rate limit keeps the transfer open for several vmictl snapshots (~0.7 s).
        procs.run(host, ["curl", "-sS", "--fail", "--max-time", "40", "--limit-rate", "100M",
                       "-o", out, f"http://{H1_IP}:{port}/file"],
                  layer=True, name="curl", timeout=45, env=env)
    assert out.stat().st_size == FILE_SIZE
    assert sha256_file(out) == digest, "downloaded file differs from the served one"
    assert_virtual(w, H1, f"{H1_IP}:{port}", host, s2c_bytes=FILE_SIZE, substrate=substrate)
