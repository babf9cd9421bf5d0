"""What importing the client side costs: no torch anywhere, and the server needs no httpx."""

from __future__ import annotations

import subprocess
import sys


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_client_imports_without_torch():
    done = _python("import sys, reef_core.client.wrapper, reef_core.client.cli; from reef_core.client import "
                   "ReefClient, AsyncReefClient; assert 'torch' not in sys.modules, 'torch was imported'")
    assert done.returncode == 0, done.stderr


def test_the_server_and_its_install_route_need_no_httpx():
    # httpx is the client's ([client] extra): a server without it still builds its app, install route included.
    done = _python("import sys; sys.modules['httpx'] = None\n"
                   "import reef_core.serve.app, reef_core.serve.routes.install, reef_core.client.tree\n"
                   "from reef_core.cli import main; assert main(['--help']) == 0")
    assert done.returncode == 0, done.stderr
