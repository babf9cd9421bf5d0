"""The per-scenario GEPA archive: gepa's own ``GEPAState`` plus what a resumable run needs beside it.

Upstream keeps a run's state in memory for one ``gepa.optimize`` call; Reef runs one iteration per
batch of reports, across restarts, so the archive persists after every iteration:

* ``state``: the library's ``GEPAState`` (candidates, parents, per-task validation scores, Pareto
  fronts, round-robin cursors, metric calls, iteration counter, trace);
* ``rng`` and ``sampler``: the ``random.Random`` shared by Pareto parent sampling, minibatch
  shuffling and merge (as ``gepa.optimize`` shares one), and the ``EpochShuffledBatchSampler``;
* ``merge``: the merge proposer's schedule (due merges, merges tested, triplets already merged);
* ``served``: which candidate the scenario serves; ``releases``: release id -> candidate.

It is written atomically (pickle, then an ``archive.json`` summary for people) under
``<data_dir>/gepa/<scenario key>/``. A fingerprint of the settings that give candidate indices
and validation ids their meaning (components, validation task keys) guards a reload: a changed
valset starts a fresh archive instead of mixing incomparable scores.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gepa.core.state import GEPAState

log = logging.getLogger("reef_gepa")

FORMAT = 1


@dataclass
class MergeSchedule:
    """The bookkeeping gepa's ``MergeProposer`` keeps between iterations."""

    merges_due: int = 0
    total_merges_tested: int = 0
    last_iter_found_new_program: bool = False
    merges_performed: tuple = field(default_factory=lambda: ([], []))


@dataclass
class Archive:
    fingerprint: dict
    rng: random.Random
    sampler: Any = None
    state: GEPAState | None = None
    merge: MergeSchedule = field(default_factory=MergeSchedule)
    served: int | None = None
    releases: dict[str, int] = field(default_factory=dict)

    # -- reading -----------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return 0 if self.state is None else len(self.state.program_candidates)

    def mean(self, idx: int) -> float:
        return self.state.get_program_average_val_subset(idx)[0]

    def best(self) -> int:
        """GEPA's best candidate: highest mean validation score, first on ties."""
        scores = self.state.program_full_scores_val_set
        return scores.index(max(scores))

    def find(self, components: dict[str, str]) -> int | None:
        if self.state is None:
            return None
        for idx, candidate in enumerate(self.state.program_candidates):
            if candidate == components:
                return idx
        return None

    def summary(self) -> dict:
        """A JSON view: candidates, parents, validation means, fronts, budget."""
        if self.state is None:
            return {"candidates": 0, "served": self.served}
        state = self.state
        front = sorted({i for f in state.get_pareto_front_mapping().values() for i in f})
        return {
            "candidates": len(state.program_candidates),
            "texts": state.program_candidates,
            "parents": state.parent_program_for_candidate,
            "val_means": [round(self.mean(i), 6) for i in range(len(state.program_candidates))],
            "best": self.best(),
            "served": self.served,
            "pareto_candidates": front,
            "iterations": state.i + 1,
            "metric_calls": state.total_num_evals,
            "full_evals": state.num_full_ds_evals,
            "merges_tested": self.merge.total_merges_tested,
        }

    # -- persistence -------------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        blob = pickle.dumps({"format": FORMAT, "archive": self}, protocol=pickle.HIGHEST_PROTOCOL)
        _atomic_write(directory / "archive.pkl", blob)
        _atomic_write(directory / "archive.json",
                      (json.dumps({"fingerprint": self.fingerprint, **self.summary()}, indent=2, default=str)
                       + "\n").encode())

    @classmethod
    def load(cls, directory: Path, fingerprint: dict, seed: int) -> "Archive":
        """The saved archive when it matches ``fingerprint``, else a fresh one seeded with ``seed``."""
        path = directory / "archive.pkl"
        if path.exists():
            try:
                data = pickle.loads(path.read_bytes())
                archive = data["archive"]
                if data.get("format") == FORMAT and archive.fingerprint == fingerprint:
                    return archive
                log.warning("GEPA archive %s was built with other settings; starting a new one", path)
            except Exception:  # noqa: BLE001 - a damaged archive restarts the search, never the server
                log.exception("GEPA archive %s is unreadable; starting a new one", path)
        return cls(fingerprint=fingerprint, rng=random.Random(seed))


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
