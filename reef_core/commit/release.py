"""Release records, the release manifest and the ref layout of the git-backed release chain.

Ref layout (all under ``refs/reef/``)::

    scenarios/<key>                        the scenario's current release (its head)
    head                                   the last release made current in any scenario
    staged/<sha>                           written, not yet current or held (in flight)
    releases/<sha>                         held for review (``pending``)
    promoted/<sha>                         a held release that was promoted (kept for audit)
    archived/<key>/<timestamp>             a deleted scenario's last head
    pruned/<sha>                           a release whose LFS weights were garbage collected

``<key>`` is :func:`scenario_key`, the sha256 of the name: every name gives a valid ref of fixed length. A name
is read back from the release manifest the ref points to. Repositories written before keys were digests used
urlsafe-base64 of the name (:func:`legacy_scenario_key`); the store renames those refs when it opens.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reef_core.errors import NotFound, ValidationFailed
from reef_core.names import scenario_digest

MANIFEST = "reef-artifact.json"
ATTRIBUTES = ".gitattributes"
RESERVED = (MANIFEST, ATTRIBUTES)
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt")
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()
OPERATIONS = ("creation", "training", "rollback", "promote", "restore", "recovery")

PREFIX = "refs/reef/"
HEAD_REF = PREFIX + "head"
SCENARIOS = PREFIX + "scenarios/"
STAGED = PREFIX + "staged/"
HELD = PREFIX + "releases/"
PROMOTED = PREFIX + "promoted/"
ARCHIVED = PREFIX + "archived/"
PRUNED = PREFIX + "pruned/"

_SHA = re.compile(r"^[0-9a-f]{40}$")
_KEY = re.compile(r"[0-9a-f]{64}")


def scenario_key(scenario: str) -> str:
    """The scenario's fixed-length key in refs and file names (see :func:`reef_core.names.scenario_digest`)."""
    validate_scenario(scenario)
    return scenario_digest(scenario)


def is_scenario_key(key: str) -> bool:
    return _KEY.fullmatch(key) is not None


def legacy_scenario_key(scenario: str) -> str:
    """The key of earlier versions (urlsafe-base64 of the name), still read where it exists."""
    return base64.urlsafe_b64encode(scenario.encode("utf-8", "surrogatepass")).decode()


def scenario_path(root: str | os.PathLike, scenario: str, suffix: str = "") -> Path:
    """``root/<scenario_key><suffix>``: the per-scenario file or directory. A file written by an earlier version
    under the base64 name is used where it still exists, so existing deployments stay readable."""
    root = Path(root)
    try:
        legacy = root / f"{legacy_scenario_key(scenario)}{suffix}"
        if legacy.exists():
            return legacy
    except (OSError, ValueError):  # a name whose base64 is too long for a file name never had a legacy file
        pass
    return root / f"{scenario_key(scenario)}{suffix}"


def scenario_from_legacy_key(key: str) -> str:
    padded = key + "=" * (-len(key) % 4)  # tolerate refs written without padding
    try:
        return base64.urlsafe_b64decode(padded.encode()).decode()
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise ValidationFailed(f"not a scenario ref key: {key!r}") from exc


def scenario_ref(scenario: str) -> str:
    return SCENARIOS + scenario_key(scenario)


def validate_scenario(scenario: str) -> None:
    """Any non-empty string names a scenario here: keys are digests, so a name stored before today's name rule
    (:mod:`reef_core.names`, applied to new names at the HTTP door) keeps working."""
    if not isinstance(scenario, str) or not scenario:
        raise ValidationFailed("scenario must be a non-empty string")


def normalize_release_id(release_id: str) -> str:
    """Accept ``<sha>`` or ``git+lfs://<sha>``; only full lowercase commit SHAs are ids."""
    if not isinstance(release_id, str):
        raise NotFound(f"unknown release {release_id!r}")
    rid = release_id.removeprefix("git+lfs://").strip().lower()
    if not _SHA.match(rid):
        raise NotFound(f"unknown release {release_id!r} (release ids are 40-hex commit SHAs)")
    return rid


def validate_path(path: str) -> str:
    """A release file path: relative, '/'-separated, no '.', '..' or '.git' parts, not reserved."""
    if not isinstance(path, str) or not path:
        raise ValidationFailed("file paths must be non-empty strings")
    if path.startswith("/") or "\\" in path or any(c in path for c in "\0\n\r"):
        raise ValidationFailed(f"invalid file path {path!r}")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", "..") or part.lower() == ".git":
            raise ValidationFailed(f"invalid file path {path!r}")
    if path in RESERVED:
        raise ValidationFailed(f"{path!r} is reserved for the release manifest and attributes")
    return path


def is_lfs_path(path: str) -> bool:
    """Whether .gitattributes routes this path to LFS (patterns match the basename)."""
    import fnmatch

    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(name, pat) for pat in LFS_PATTERNS)


def content_id_of(files: dict[str, dict]) -> str:
    """Digest of the file tree content: paths, sizes and sha256 of the real bytes.

    Independent of the manifest, of LFS pointer encoding and of history, so a rollback
    republish of the same files has the same content id.
    """
    h = hashlib.sha256()
    for path in sorted(files):
        meta = files[path]
        h.update(f"{path}\0{meta['size']}\0{meta['sha256']}\n".encode())
    return "sha256:" + h.hexdigest()


def parse_lfs_pointer(data: bytes) -> tuple[str, int] | None:
    """(oid, size) when ``data`` is a git-lfs pointer file, else None."""
    if len(data) > 1024 or not data.startswith(b"version https://git-lfs.github.com/spec/v1\n"):
        return None
    oid = size = None
    for line in data.decode(errors="replace").splitlines()[1:]:
        key, _, value = line.partition(" ")
        if key == "oid" and value.startswith("sha256:"):
            oid = value[len("sha256:") :]
        elif key == "size" and value.isdigit():
            size = int(value)
    if oid is None or size is None or not re.fullmatch(r"[0-9a-f]{64}", oid):
        return None
    return oid, size


def dumps_manifest(manifest: dict) -> bytes:
    return (json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


@dataclass(frozen=True)
class Release:
    """One publication decision: a commit of the release chain and its manifest.

    ``current``, ``pending`` and ``restorable`` describe the store at the time of the read.
    """

    release_id: str
    scenario: str
    parent_release_id: str | None
    content_id: str
    operation: str
    created_at: str
    source: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    evaluation: dict | None = None
    files: dict = field(default_factory=dict)  # path -> {size, sha256, lfs}
    log_row: dict | None = None  # the commit-log row the publisher intended (recovery aid)
    current: bool = False
    pending: bool = False
    restorable: bool = True
    state: str = "chain"  # chain | held | promoted | staged | unreferenced

    @classmethod
    def from_manifest(cls, release_id: str, manifest: dict, **flags: Any) -> "Release":
        return cls(
            release_id=release_id,
            scenario=manifest["scenario"],
            parent_release_id=manifest.get("parent_release_id"),
            content_id=manifest["content_id"],
            operation=manifest.get("operation", "training"),
            created_at=manifest.get("created_at", ""),
            source=manifest.get("source") or {},
            metrics=manifest.get("metrics") or {},
            evaluation=manifest.get("evaluation"),
            files=manifest.get("files") or {},
            log_row=manifest.get("commit"),
            **flags,
        )

    def lfs_oids(self) -> set[str]:
        return {meta["sha256"] for meta in self.files.values() if meta.get("lfs")}

    def to_dict(self) -> dict:
        """The release row of the HTTP contract (``GET /reef/scenarios/{s}/releases``)."""
        return {
            "release_id": self.release_id,
            "scenario": self.scenario,
            "parent_release_id": self.parent_release_id,
            "content_id": self.content_id,
            "operation": self.operation,
            "source": self.source,
            "metrics": self.metrics,
            "evaluation": self.evaluation,
            "created_at": self.created_at,
            "current": self.current,
            "pending": self.pending,
            "restorable": self.restorable,
            "checkpoint": True,
            "content_kind": "saved_artifact",
        }
