"""A scenario whose records were served by known releases with known scores, for the comparison and alias tests.

A harness recipe (``dashboard_loop.RewardTrainer``, every candidate selected) trains on each batch of
:data:`BATCH` reports; each round serves :data:`BATCH` requests with the head of the time, reports their scores
(:data:`ROUNDS`) and waits for the next release, so round *i*'s records are release *i*'s.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from ..background import serve_asgi
from ..config import compose_config
from ..loop.assemble import build_deployment
from ..serve.app import create_app
from .fixtures import wait_until

TOKEN, ADMIN = "loop-read-token", "loop-admin-token"
BATCH = 4
#: Reported scores of each round's records: release 0 (the seed) mean 0.25, release 1 mean 0.75.
ROUNDS = ([0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0])


@dataclass
class ReleaseLoop:
    url: str
    scenario: str
    #: The release that served each round, oldest first, then the head the last round's batch made.
    served: list[str]
    head: str


def _head(client: httpx.Client, scenario: str) -> str:
    return client.get(f"/reef/scenarios/{scenario}/status").json()["current_release_id"]


@contextmanager
def release_loop(data_dir: Path, upstream_url: str, scenario: str = "cmp loop",
                 overrides: tuple[str, ...] = ()) -> Iterator[ReleaseLoop]:
    cfg = compose_config([
        "engine.kind=upstream", f"engine.upstream_url={upstream_url}", f"storage.data_dir={data_dir}",
        f"server.tokens=[{TOKEN}]", f"server.admin_tokens=[{ADMIN}]",
        "recipe.name=cmp", "recipe.processor=per_report", f"+recipe.processor_options.batch_size={BATCH}",
        "recipe.trainer=reef_core.testing.dashboard_loop:RewardTrainer", "recipe.surface=harness",
        "evaluation.policy=always", *overrides])
    with serve_asgi(create_app(build_deployment(cfg)), lifespan="on") as url:
        headers = {"authorization": f"Bearer {ADMIN}", "x-reef-scenario": scenario}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            served = []
            for round_, scores in enumerate(ROUNDS):
                receipts = []
                for i in range(BATCH):
                    answer = client.post("/v1/chat/completions", json={
                        "model": "m", "messages": [{"role": "user", "content": f"round {round_} q{i}"}]})
                    assert answer.status_code == 200, answer.text
                    receipts.append(answer.headers["x-reef-agent-record-id"])
                served.append(_head(client, scenario))
                for receipt, score in zip(receipts, scores):
                    report = client.post("/reef/report", json={"score": score, "references": [receipt]})
                    assert report.status_code == 200, report.text
                wait_until(lambda: _head(client, scenario) != served[-1], timeout=60,
                           what=f"round {round_}'s batch trained into a release")
            yield ReleaseLoop(url, scenario, served, _head(client, scenario))
