"""The task contract's shared rules: guidance parsing, task loading, the executor behind an OpenAI-compatible URL."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from reef_core.api import ConfigError
from reef_ttt.task import load_executor, load_task, parse_guidance
from reef_ttt.tasks import circle_packing as cp


@pytest.mark.parametrize("text, tags, expected", [
    ("<guidance>grow</guidance>", True, "grow"),
    ("thinking... <guidance> swap 3 </guidance>", True, "swap 3"),
    ("<guidance></guidance>", True, None),
    ("<guidance>a</guidance><guidance>b</guidance>", True, None),
    ("<guidance>unclosed", True, None),
    ("no tags", True, None),
    ("no tags", False, "no tags"),
    ("   ", False, None),
])
def test_parse_guidance(text, tags, expected):
    assert parse_guidance(text, tags=tags) == expected


def test_load_task_names_the_key():
    assert load_task("reef_ttt.tasks.circle_packing:make_task", {"n": 5}).n == 5
    with pytest.raises(ConfigError, match="recipe.options.task"):
        load_task("reef_ttt.tasks.nope:make_task")
    with pytest.raises(ConfigError, match="task_options"):
        load_task("reef_ttt.tasks.circle_packing:make_task", {"m": 1})


def test_executor_behind_an_openai_compatible_url():
    child = cp.seeds(5)[0]
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append((self.path, body["messages"][0]["content"]))
            reply = {"choices": [{"message": {"role": "assistant",
                                              "content": f"done <solution>{json.dumps(child)}</solution>"}}]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        task = cp.CirclePacking(5)
        executor = load_executor(f"http://127.0.0.1:{server.server_port}/v1", task)
        assert executor(cp.seeds(5)[1], "grow the corner circle", seed=1) == child
        assert seen[0][0] == "/v1/chat/completions" and "grow the corner circle" in seen[0][1]
    finally:
        server.shutdown()
    assert load_executor(None, task) == task.execute
    assert load_executor("reef_ttt.tasks.circle_packing:execute", task) is cp.execute
