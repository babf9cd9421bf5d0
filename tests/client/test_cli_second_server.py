"""A second ``reef serve`` on a data directory another server writes: one line naming the holder, exit 1, before
the model loads (#37 first use 5: it was 82 lines of lifespan traceback and uvicorn's exit 3)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def test_second_server_on_one_data_dir_gets_one_line(live_reef, fake_upstream_url):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith("REEF_")}
    second = subprocess.run([sys.executable, "-m", "reef_core.cli", "serve", "engine.kind=upstream",
                             f"engine.upstream_url={fake_upstream_url}", f"storage.data_dir={live_reef.data_dir}",
                             f"server.port={port}"], env=base, capture_output=True, text=True, timeout=120)
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 1, second.stderr
    assert len(lines) == 1 and "already have a writer" in lines[0] and "reef: error:" in lines[0], second.stderr
    assert "Traceback" not in second.stderr
