"""Eight real processes race to publish on one scenario with the same expected parent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from reef_core.commit.git_store import GitArtifactStore
from reef_core.testing.chain import publish

ROOT = Path(__file__).resolve().parents[2]
RACERS = 8
ROUNDS = 3

# Each racer opens its own store, then for every "publish <parent> <round>" line on stdin
# tries one CAS publish and answers "won <sha>" or "lost".
WORKER = r"""
import sys
from reef_core.commit.git_store import GitArtifactStore
from reef_core.errors import Conflict
from reef_core.testing.chain import publish

repo, work, me = sys.argv[1], sys.argv[2], sys.argv[3]
store = GitArtifactStore(repo, work)
print("ready", flush=True)
for line in sys.stdin:
    _, parent, rnd = line.split()
    try:
        rel = publish(store, "race", {"who.txt": f"{me}/{rnd}".encode()}, expected_parent=parent)
        print("won", rel.release_id, flush=True)
    except Conflict:
        print("lost", flush=True)
"""


def test_exactly_one_winner_per_parent(tmp_path):
    repo = tmp_path / "artifacts.git"
    store = GitArtifactStore(repo, tmp_path / "w-main")
    genesis = publish(store, "race", {"who.txt": b"genesis"}, expected_parent=None, operation="creation")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(repo), str(tmp_path / f"w{i}"), str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for i in range(RACERS)
    ]
    try:
        for p in procs:  # start barrier: every racer has imported and opened its store
            assert p.stdout.readline().strip() == "ready"
        parent = genesis.release_id
        winners = []
        for rnd in range(ROUNDS):
            for p in procs:  # all racers get the same expected parent at (nearly) the same time
                p.stdin.write(f"publish {parent} {rnd}\n")
                p.stdin.flush()
            answers = [p.stdout.readline().split() for p in procs]
            won = [a[1] for a in answers if a[0] == "won"]
            assert len(won) == 1, answers
            assert sum(a == ["lost"] for a in answers) == RACERS - 1
            assert store.get(won[0]).parent_release_id == parent
            winners.append(won[0])
            parent = won[0]
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            assert p.wait(timeout=60) == 0
    chain = store.releases("race")
    assert [r.release_id for r in chain] == list(reversed(winners)) + [genesis.release_id]
    assert len(chain) == ROUNDS + 1
    assert store.head("race").release_id == winners[-1]
    assert store.staged() == []  # every loser withdrew its staged commit
