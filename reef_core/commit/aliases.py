"""Release aliases of a scenario (``staging``, custom names) as an append-only, audited git log.

Each scenario's aliases live on one ref, ``refs/reef/aliases/<scenario key>``, in the release repository: every
move is a commit whose tree holds ``aliases.json`` (every alias of the scenario -> release id, after the move) and
``move.json`` (this move: ``alias``, ``from``, ``to``, ``by``, ``at``, ``reason``), its parent the move before. The
ref moves only by compare-and-swap (:mod:`reef_core.commit.refs`), so two concurrent moves never lose one, and the
log is pushed and fetched with the releases (a remote repository holds it too). Nothing is rewritten: history is
the commit chain, newest first.

``production`` is not stored here: it is the scenario's head, moved through the release chain (rollback/promote),
whose releases are its history (:mod:`reef_core.loop.aliases`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from datetime import datetime, timezone

from reef_core.commit._git import ZERO, Git
from reef_core.commit.refs import LocalRefs, RefUpdate
from reef_core.commit.release import PREFIX, scenario_key
from reef_core.errors import Conflict

ALIASES = PREFIX + "aliases/"
_STATE, _MOVE = "aliases.json", "move.json"


def alias_ref(scenario: str) -> str:
    return ALIASES + scenario_key(scenario)


class AliasLog:
    """The alias log of every scenario in one release repository."""

    def __init__(self, git: Git, refs: LocalRefs, lock: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.git = git
        self.refs = refs
        #: Held around a move: the repository's shared lock, so ``reef gc`` (which holds it exclusively while it
        #: deletes weights, retaining every aliased release) never races a move to a release it is pruning.
        self.lock = lock or contextlib.nullcontext

    def _tip(self, scenario: str) -> str | None:
        return self.refs.get(alias_ref(scenario))  # a remote's refs are fetched first

    def _state(self, tip: str | None) -> dict[str, str]:
        blob = self.git.cat_batch([f"{tip}:{_STATE}"])[0] if tip else None
        return json.loads(blob) if blob else {}

    def current(self, scenario: str) -> dict[str, str]:
        """``alias -> release id`` now."""
        return self._state(self._tip(scenario))

    def history(self, scenario: str, alias: str | None = None, limit: int = 100) -> list[dict]:
        """The moves (of ``alias``, or of every alias), newest first, at most ``limit``."""
        tip = self._tip(scenario)
        if tip is None:
            return []
        commits = self.git.out("rev-list", "--first-parent", tip).split()
        moves = []
        for blob in self.git.cat_batch([f"{sha}:{_MOVE}" for sha in commits]):
            move = json.loads(blob) if blob else None
            if move is not None and (alias is None or move.get("alias") == alias):
                moves.append(move)
                if len(moves) >= limit:
                    break
        return moves

    def move(self, scenario: str, alias: str, release_id: str, *, by: str, reason: str, attempts: int = 3) -> dict:
        """Point ``alias`` at ``release_id``, recording who, when and why; return the move. A concurrent move of
        the same scenario's log is retried on the new tip (Conflict after ``attempts``)."""
        with self.lock():
            return self._move(scenario, alias, release_id, by=by, reason=reason, attempts=attempts)

    def _move(self, scenario: str, alias: str, release_id: str, *, by: str, reason: str, attempts: int) -> dict:
        for _ in range(attempts):
            tip = self._tip(scenario)
            state = self._state(tip)
            move = {"alias": alias, "from": state.get(alias), "to": release_id, "by": by, "reason": reason,
                    "at": datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")}
            state[alias] = release_id
            tree = self._tree({_STATE: json.dumps(state, sort_keys=True, indent=2) + "\n",
                               _MOVE: json.dumps(move, sort_keys=True, indent=2) + "\n"})
            args = ["commit-tree", tree, "-m", f"reef alias {alias}: {scenario}\n\n{move['from']} -> {release_id}"]
            if tip:
                args += ["-p", tip]
            sha = self.git.out(*args)
            try:
                self.refs.transaction([RefUpdate(alias_ref(scenario), sha, tip or ZERO)])
                return move
            except Conflict:
                continue
        raise Conflict(f"aliases of scenario {scenario!r} kept moving under this move; try again")

    def _tree(self, files: dict[str, str]) -> str:
        entries = []
        for name, text in sorted(files.items()):
            blob = self.git.out("hash-object", "-w", "--stdin", input=text.encode())
            entries.append(f"100644 blob {blob}\t{name}\0".encode())
        return self.git.out("mktree", "-z", input=b"".join(entries))

