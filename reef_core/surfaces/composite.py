"""A composite surface: one scenario served by several surfaces at once (e.g. weights + a harness system prompt).

A composite release's tree holds each part's files under the part's name: ``weights/model.safetensors``,
``harness/system_prompt.md``. Each part validates, activates and shapes requests with its own slice, unprefixed,
exactly as it would alone. The recipe's ``changes`` names the parts its trainer changes; :meth:`carry` completes a
candidate with the other parts' current files, so every release records all of them.

Activation is atomic: parts activate in ``surfaces`` order; a part whose slice is byte-for-byte what it serves now
is left alone (a harness step does not reload the weights). When a part raises, the parts this call already moved
are activated again from the release that served before, then the error propagates, so the learner's
activation-failure path (a ``restore`` release, ``activation_failures``) runs as for one surface and serving never
runs a mix.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import ValidationFailed
from .base import Surface

log = logging.getLogger("reef.surfaces.composite")


def kinds_of(surface: Any) -> tuple[str, ...]:
    """The kinds that serve a scenario: a composite's parts' kinds, else the surface's own kind."""
    if surface is None:
        return ()
    return tuple(getattr(surface, "kinds", None) or (getattr(surface, "kind", None) or "none",))


def changed_kinds(surface: Any) -> tuple[str, ...]:
    """The kinds a trainer's candidates change: a composite's ``changes``, else the surface's own kind."""
    if isinstance(surface, CompositeSurface):
        return tuple(getattr(surface.parts[n], "kind", "none") for n in surface.changes)
    return kinds_of(surface)


def part_slice(files: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The files of part ``name`` in a composite tree, unprefixed."""
    prefix = name + "/"
    return {path[len(prefix):]: files[path] for path in files if path.startswith(prefix)}


class ComposedFiles(Mapping):
    """A composite tree over the parts' own mappings (a trainer's lazily serialised weights stay lazy)."""

    def __init__(self, parts: Mapping[str, Mapping[str, Any]]):
        self._parts = dict(parts)

    def __getitem__(self, path: str) -> Any:
        name, _, rest = path.partition("/")
        if name not in self._parts or not rest:
            raise KeyError(path)
        return self._parts[name][rest]

    def __iter__(self) -> Iterator[str]:
        for name, files in self._parts.items():
            for path in files:
                yield f"{name}/{path}"

    def __len__(self) -> int:
        return sum(len(files) for files in self._parts.values())


def _digest(files: Mapping[str, Any]) -> str:
    digest = hashlib.sha256()
    for path in sorted(files):
        data = files[path]
        digest.update(path.encode() + b"\0" + (data.encode() if isinstance(data, str) else bytes(data)) + b"\0")
    return digest.hexdigest()


class CompositeSurface(Surface):
    """Serves a scenario through ``parts`` (name -> surface, in activation order); ``changes``: the parts its
    trainer's candidates change (a trainer changing one part returns that part's files unprefixed)."""

    kind = "composite"

    def __init__(self, parts: Mapping[str, Surface], changes: tuple[str, ...], artifacts: Any = None):
        self.parts = dict(parts)
        self.changes = tuple(changes)
        self.kinds = tuple(getattr(p, "kind", "none") for p in self.parts.values())
        self.artifacts = artifacts
        self._lock = threading.Lock()
        #: scenario -> (release id, part -> digest of the slice it serves)
        self._served: dict[str, tuple[str | None, dict[str, str]]] = {}

    def part(self, kind: str) -> Surface | None:
        """The part of this kind (e.g. the weights part a learner claims), or None."""
        return next((p for p in self.parts.values() if getattr(p, "kind", None) == kind), None)

    def claim(self, scenario: str, lora: bool = False) -> None:
        weights = self.part("weights")
        if weights is not None and "weights" in self.changes:
            weights.claim(scenario, lora=lora)

    # -- files ---------------------------------------------------------------------------------------------

    def trainer_view(self, files: Mapping[str, Any]) -> Mapping[str, Any]:
        """What the trainer sees of a release: its one changed part's files, unprefixed (else the whole tree)."""
        return part_slice(files, self.changes[0]) if len(self.changes) == 1 else files

    def carry(self, files: Mapping[str, Any], previous: Callable[[], Mapping[str, Any]]) -> Mapping[str, Any]:
        """A candidate's composite tree: the trainer's ``files`` for the parts it changes, every other part's
        current files (``previous()``, the head's tree) carried forward, or its creation files at the start."""
        if len(self.changes) == 1:
            changed = {self.changes[0]: files}
        else:
            # Several changed parts: the trainer's tree is prefixed; a part it leaves out is carried forward too.
            changed = {name: found for name in self.changes if (found := part_slice(files, name))}
        head = None
        out = {}
        for name, surface in self.parts.items():
            if name in changed:
                out[name] = changed[name]
                continue
            head = previous() if head is None else head
            out[name] = part_slice(head, name) or dict(surface.creation_files())
        return ComposedFiles(out)

    def creation_files(self) -> Mapping[str, Any]:
        return ComposedFiles({name: dict(p.creation_files()) for name, p in self.parts.items()})

    def _split(self, files: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        stray = sorted(p for p in files if p.partition("/")[0] not in self.parts or "/" not in p)
        if stray:
            raise ValidationFailed(f"a composite release holds files under {', '.join(n + '/' for n in self.parts)} "
                                   f"only; got {stray[0]!r}")
        return {name: part_slice(files, name) for name in self.parts}

    def validate(self, files: Mapping[str, Any]) -> None:
        for name, part in self._split(files).items():
            self.parts[name].validate(part)

    def validate_successor(self, files, previous) -> None:
        for name, part in self._split(files).items():
            self.parts[name].validate_successor(part, lambda name=name: part_slice(previous(), name))

    def warm(self) -> None:
        for part in self.parts.values():
            part.warm()

    # -- activation ----------------------------------------------------------------------------------------

    def activate(self, scenario, release_id, payload=None, files=None) -> None:
        if files is None:
            raise ValidationFailed("a composite release activates from its stored files (it is always durable)")
        with self._lock:
            tree = files()
            slices = self._split(tree)
            before_id, before = self._served.get(scenario, (None, {}))
            moved: list[str] = []
            served = dict(before)
            try:
                for name, surface in self.parts.items():
                    digest = _digest(slices[name])
                    if before.get(name) == digest:
                        continue  # this part already serves this content
                    part_payload = payload if self.changes == (name,) else None
                    moved.append(name)
                    surface.activate(scenario, release_id, payload=part_payload,
                                     files=lambda name=name: slices[name])
                    served[name] = digest
            except Exception:
                self._restore(scenario, before_id, moved[:-1])
                raise
            self._served[scenario] = (release_id, served)

    def _restore(self, scenario: str, release_id: str | None, names: list[str]) -> None:
        """Activate ``names`` again from ``release_id`` (what served before). A part that cannot be restored loses
        its digest, so the learner's ``restore`` release activates it again instead of skipping it."""
        if not names:
            return
        try:
            if release_id is None or self.artifacts is None:
                raise ValidationFailed("no earlier release to restore")
            previous = self._split(self.artifacts.read_files(release_id))
            for name in list(names):
                self.parts[name].activate(scenario, release_id, files=lambda name=name: previous[name])
                names.remove(name)
        except Exception:  # noqa: BLE001 - the activation's own error is what the caller reports
            log.error("scenario %s: composite parts %s not restored to %s", scenario, names, release_id, exc_info=True)
            served = self._served.get(scenario)
            if served is not None:
                self._served[scenario] = (served[0], {k: v for k, v in served[1].items() if k not in names})

    # -- serving -------------------------------------------------------------------------------------------

    def serving_version(self, scenario: str) -> str | None:
        """The weights part's version when there is one (records and staleness use it), else the release id."""
        weights = self.part("weights")
        if weights is not None:
            return weights.serving_version(scenario)
        return self._served.get(scenario, (None, {}))[0]

    def prepare_request(self, scenario: str, dialect: str, body: dict) -> tuple[dict, str | None]:
        # Only once activated: a part alone would read the head's (prefixed) tree itself.
        if scenario not in self._served:
            return body, None
        for part in self.parts.values():
            body, _ = part.prepare_request(scenario, dialect, body)
        return body, self._served[scenario][0]

    def response_headers(self, scenario: str, release_id: str | None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if scenario not in self._served:
            return headers
        for part in self.parts.values():
            headers.update(part.response_headers(scenario, release_id))
        return headers
