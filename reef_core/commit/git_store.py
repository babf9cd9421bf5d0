"""Git + git-lfs release store: an append-only chain of releases with compare-and-swap heads.

Every release is a commit whose tree holds the released files, a ``.gitattributes`` routing
weight files (``*.safetensors *.bin *.pt *.pth *.ckpt``) to LFS, and ``reef-artifact.json``
(see :func:`GitArtifactStore.stage`). Weight files are stored as LFS pointers, byte-identical to
what ``git lfs clean`` prints; the objects live in the repository's LFS store, so a clone plus
``git lfs pull`` restores them.

Commits are built without a work tree: a publish writes its blobs, trees, commit and LFS objects
in process (:mod:`reef_core.commit._objects`, fsynced before any ref names them; a republish
reuses trees through ``mktree``/``commit-tree``), and a head only moves by compare-and-swap
(``git update-ref <ref> <new> <old>`` in a transaction, or a push with ``--force-with-lease``
for a remote repository). History is never rewritten:
rollback and promote republish existing content as a new child of the current head.

Publishing is split into steps so a caller can put its own commit point in between
(see :mod:`reef_core.commit.committer`)::

    stage()    write the release commit, reachable only from refs/reef/staged/<sha>
    advance()  CAS the scenario head from the release's parent to it (drops the staged ref)
    hold()     instead of advancing, keep it for review under refs/reef/releases/<sha>
    discard()  drop a staged release that lost or was abandoned

The committer is the one caller that publishes (it writes the commit-log row between the steps);
tests of the store alone use :mod:`reef_core.testing.chain`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Mapping

from reef_core.commit._git import ZERO, Git, GitCommandError, check_git_lfs
from reef_core.commit._objects import ObjectWriter
from reef_core.commit.refs import LocalRefs, RefUpdate, RemoteRefs
from reef_core.commit.release import (
    ARCHIVED,
    ATTRIBUTES,
    GITATTRIBUTES,
    HEAD_REF,
    HELD,
    MANIFEST,
    OPERATIONS,
    PRUNED,
    PROMOTED,
    SCENARIOS,
    STAGED,
    Release,
    content_id_of,
    dumps_manifest,
    is_lfs_path,
    normalize_release_id,
    parse_lfs_pointer,
    is_scenario_key,
    scenario_from_legacy_key,
    scenario_key,
    scenario_ref,
    validate_path,
    validate_scenario,
)
from reef_core.commit.store import FileValue
from reef_core.errors import ConfigError, Conflict, NotFound, StorageUnavailable, ValidationFailed

log = logging.getLogger(__name__)

_REPO_CONFIG = {"core.logAllRefUpdates": "always", "core.fsync": "committed"}
_MANIFEST_CACHE = 4096  # manifests kept in memory (a few KiB each)
_SCP_URL = re.compile(r"^[\w.-]+@[\w.-]+:")


def _is_url(repo: str | os.PathLike) -> bool:
    text = os.fspath(repo)
    return "://" in text or bool(_SCP_URL.match(text))


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _iso(ts: datetime) -> str:
    return ts.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _jsonable(value, what: str):
    if value is None:
        return None
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise ValidationFailed(f"{what} must be JSON-serialisable: {exc}") from exc


class GitArtifactStore:
    """Releases of every scenario in one git repository (local bare path or remote URL).

    ``repo``: a local path (a bare repository, created with ``git init --bare`` when absent) or
    a git URL (worked through a bare mirror in ``work_dir``). ``work_dir``: caches
    (materialized releases, temporary blobs, the remote mirror).
    """

    def __init__(self, repo: str | os.PathLike, work_dir: str | os.PathLike):
        self.lfs_version = check_git_lfs()
        self.work_dir = Path(work_dir).resolve()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if _is_url(repo):
            self.url: str | None = os.fspath(repo)
            git_dir = self.work_dir / "mirror.git"
            if not (git_dir / "HEAD").exists():
                Git.init_bare(git_dir)
            self.git = Git(git_dir)
            if self.git.config_get("remote.origin.url") != self.url:
                if self.git.config_get("remote.origin.url") is None:
                    self.git.run("remote", "add", "origin", self.url)
                else:
                    self.git.run("remote", "set-url", "origin", self.url)
            self._refs: LocalRefs = RemoteRefs(self.git)
        else:
            self.url = None
            git_dir = Path(repo).resolve()
            if (git_dir / ".git").is_dir():
                git_dir = git_dir / ".git"
            if git_dir.exists() and not (git_dir / "HEAD").exists():
                if any(git_dir.iterdir()):
                    raise ConfigError(f"{git_dir} exists and is not a git repository")
            if not (git_dir / "HEAD").exists():
                Git.init_bare(git_dir)
            self.git = Git(git_dir)
            self._refs = LocalRefs(self.git)
        self._configure()
        storage = self.git.config_get("lfs.storage")
        lfs_root = (self.git.git_dir / storage) if storage else self.git.git_dir / "lfs"
        self.media_dir = lfs_root / "objects"
        self._lock_path = self.git.git_dir / "reef-gc.lock"
        # Commits are immutable: a release's manifest, once read (or written), is kept (sha -> manifest).
        self._manifest_cache: dict[str, dict] = {}
        self._rename_legacy_refs()

    # ------------------------------------------------------------------ setup and locking

    def _configure(self) -> None:
        for key, value in _REPO_CONFIG.items():
            for attempt in range(5):
                if self.git.config_get(key) == value:
                    break
                try:
                    self.git.run("config", key, value)
                except GitCommandError:  # config.lock held by a concurrent store
                    if attempt == 4:
                        raise

    def _rename_legacy_refs(self) -> None:
        """Move refs keyed by base64 of the name (earlier versions) to digest keys, in one transaction."""
        try:
            snap = self._snapshot()
        except StorageUnavailable as exc:  # an unreachable remote must not stop start-up; renamed on a later open
            log.warning("release refs not checked for legacy keys: %s", exc.message)
            return
        updates = []
        for ref, sha in snap.items():
            for prefix in (SCENARIOS, ARCHIVED):
                if not ref.startswith(prefix):
                    continue
                key, sep, rest = ref[len(prefix):].partition("/")
                if is_scenario_key(key):
                    continue
                try:
                    name = scenario_from_legacy_key(key)
                except ValidationFailed:
                    log.warning("release ref %s: key is neither a digest nor base64; left as is", ref)
                    continue
                target = f"{prefix}{scenario_key(name)}{sep}{rest}"
                updates += [RefUpdate(target, sha, ZERO), RefUpdate(ref, ZERO, sha)]
        if updates:
            try:
                self._refs.transaction(updates)
                log.info("renamed %d release refs to digest keys", len(updates) // 2)
            except Conflict:  # another process renamed them first
                pass

    @property
    def is_remote(self) -> bool:
        return self.url is not None

    def aliases(self):
        """The scenarios' release aliases, kept in this repository (:class:`~reef_core.commit.aliases.AliasLog`)."""
        from reef_core.commit.aliases import AliasLog

        return AliasLog(self.git, self._refs, lock=lambda: self._flock(fcntl.LOCK_SH))

    @property
    def git_dir(self) -> Path:
        return self.git.git_dir

    @contextlib.contextmanager
    def _flock(self, mode: int) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def exclusive_lock(self):
        """Held by garbage collection: no release is being staged while LFS objects are deleted."""
        return self._flock(fcntl.LOCK_EX)

    # ------------------------------------------------------------------ reading

    def _snapshot(self) -> dict[str, str]:
        self._refs.sync()
        return self._refs.snapshot()

    def _manifests(self, shas: list[str]) -> dict[str, dict | None]:
        cache = self._manifest_cache
        result: dict[str, dict | None] = {s: cache[s] for s in shas if s in cache}
        missing = [s for s in shas if s not in result]
        blobs = self.git.cat_batch([f"{s}:{MANIFEST}" for s in missing])
        for sha, blob in zip(missing, blobs):
            try:
                manifest = json.loads(blob) if blob is not None else None
            except ValueError:
                manifest = None
            if manifest is not None and not {"scenario", "content_id"} <= manifest.keys():
                manifest = None
            if manifest is not None and len(sha) == 40:  # a full commit id names the same content forever
                if len(cache) >= _MANIFEST_CACHE:
                    cache.clear()
                cache[sha] = manifest
            result[sha] = manifest
        return result

    def _is_ancestor(self, sha: str, tip: str) -> bool:
        return self.git.run("merge-base", "--is-ancestor", sha, tip, check=False).returncode == 0

    def _restorable(self, sha: str, manifest: dict, snap: dict[str, str]) -> bool:
        if PRUNED + sha in snap:
            return False
        if self.is_remote:  # objects may live only on the remote; GC marks what it removed
            return True
        return all(
            self.lfs_path(meta["sha256"]).exists()
            for meta in (manifest.get("files") or {}).values()
            if meta.get("lfs")
        )

    def _release(self, sha: str, manifest: dict, snap: dict[str, str], state: str) -> Release:
        return Release.from_manifest(
            sha,
            manifest,
            current=snap.get(scenario_ref(manifest["scenario"])) == sha,
            pending=HELD + sha in snap,
            restorable=self._restorable(sha, manifest, snap),
            state=state,
        )

    def _locate(self, sha: str, manifest: dict, snap: dict[str, str]) -> str | None:
        for prefix, state in ((STAGED, "staged"), (HELD, "held"), (PROMOTED, "promoted")):
            if prefix + sha in snap:
                return state
        key = scenario_key(manifest["scenario"])
        head = snap.get(SCENARIOS + key)
        if head and (head == sha or self._is_ancestor(sha, head)):
            return "chain"
        for ref, tip in snap.items():
            if ref.startswith(f"{ARCHIVED}{key}/") and (tip == sha or self._is_ancestor(sha, tip)):
                return "archived"
        return None

    def get(self, release_id: str) -> Release:
        """The release with this id (commit SHA, or ``git+lfs://<sha>``); NotFound otherwise.

        Commits that never became a release (lost races, discarded stages) are not found.
        """
        sha = normalize_release_id(release_id)
        snap = self._snapshot()
        return self._get(sha, snap)

    def _get(self, sha: str, snap: dict[str, str]) -> Release:
        manifest = self._manifest_cache.get(sha)
        if manifest is None:
            is_commit, blob = self.git.cat_batch([f"{sha}^{{commit}}", f"{sha}:{MANIFEST}"])
            manifest = self._manifests([sha])[sha] if is_commit is not None and blob else None
        state = self._locate(sha, manifest, snap) if manifest else None
        if state is None:
            raise NotFound(f"unknown release {sha}")
        return self._release(sha, manifest, snap, state)

    def head(self, scenario: str) -> Release | None:
        """The scenario's current release, or None for an unknown (or archived) scenario."""
        snap = self._snapshot()
        sha = snap.get(scenario_ref(scenario))
        if sha is None:
            return None
        return self._get(sha, snap)

    def scenarios(self) -> list[str]:
        """Names of the scenarios that have a head (archived ones excluded)."""
        snap = self._snapshot()
        heads = [sha for ref, sha in snap.items() if ref.startswith(SCENARIOS)]
        return sorted({m["scenario"] for m in self._manifests(heads).values() if m})

    def releases(self, scenario: str) -> list[Release]:
        """The scenario's releases, newest first: its chain plus held (pending/promoted) ones."""
        validate_scenario(scenario)
        snap = self._snapshot()
        head = snap.get(scenario_ref(scenario))
        chain_ids = self.git.out("rev-list", "--first-parent", head).split() if head else []
        side_ids = [r.rsplit("/", 1)[1] for r in snap if r.startswith((HELD, PROMOTED))]
        manifests = self._manifests(chain_ids + side_ids)
        chain = [
            self._release(s, manifests[s], snap, "chain") for s in chain_ids if manifests[s]
        ]
        side = sorted(
            (
                self._release(s, manifests[s], snap, "held" if HELD + s in snap else "promoted")
                for s in side_ids
                if manifests[s] and manifests[s]["scenario"] == scenario
            ),
            key=lambda r: r.created_at,
            reverse=True,
        )
        # Merge held rows into the chain by time without reordering the chain itself.
        rows: list[Release] = []
        i = j = 0
        while i < len(chain) or j < len(side):
            if j < len(side) and (i == len(chain) or side[j].created_at > chain[i].created_at):
                rows.append(side[j])
                j += 1
            else:
                rows.append(chain[i])
                i += 1
        return rows

    def staged(self, scenario: str | None = None) -> list[Release]:
        """Releases written but neither advanced nor held (in flight, or left by a crash)."""
        snap = self._snapshot()
        ids = [r[len(STAGED) :] for r in snap if r.startswith(STAGED)]
        manifests = self._manifests(ids)
        out = [
            self._release(s, m, snap, "staged")
            for s, m in manifests.items()
            if m and (scenario is None or m["scenario"] == scenario)
        ]
        return sorted(out, key=lambda r: r.created_at)

    def archived(self, scenario: str | None = None) -> list[dict]:
        """Archived scenario heads: ``{scenario, ref, release_id, archived_at}``."""
        snap = self._snapshot()
        archived = sorted((ref, sha) for ref, sha in snap.items() if ref.startswith(ARCHIVED))
        manifests = self._manifests(list({sha for _, sha in archived}))
        rows = []
        for ref, sha in archived:
            stamp = ref.rpartition("/")[2]
            name = (manifests.get(sha) or {}).get("scenario")  # the name lives in the manifest, not the key
            if name is not None and (scenario is None or name == scenario):
                rows.append({"scenario": name, "ref": ref, "release_id": sha, "archived_at": stamp})
        return rows

    # ------------------------------------------------------------------ content

    def lfs_path(self, oid: str) -> Path:
        return self.media_dir / oid[0:2] / oid[2:4] / oid

    def read_files(self, release_id: str) -> dict[str, bytes]:
        """The released files, byte-identical to what was published (LFS content resolved).

        Raises Conflict when the release's weights were garbage collected (not restorable).
        """
        rel = self.get(release_id)
        listing = self.git.run("ls-tree", "-r", "-z", "--full-tree", rel.release_id).stdout
        entries = []
        for item in listing.split(b"\0"):
            if not item:
                continue
            meta, _, path = item.partition(b"\t")
            mode, kind, blob = meta.decode().split()
            name = path.decode()
            if kind == "blob" and name not in (MANIFEST, ATTRIBUTES):
                entries.append((name, blob))
        blobs = self.git.cat_batch([b for _, b in entries])
        wanted = {rel.files[n]["sha256"] for n, _ in entries if rel.files.get(n, {}).get("lfs")}
        if self.is_remote and any(not self.lfs_path(o).exists() for o in wanted):
            with contextlib.suppress(GitCommandError):
                self.git.run("lfs", "fetch", "origin", rel.release_id)
        files: dict[str, bytes] = {}
        for (name, _), data in zip(entries, blobs):
            meta = rel.files.get(name, {})
            pointer = parse_lfs_pointer(data) if meta.get("lfs") else None
            if pointer is not None:
                data = self._read_lfs(rel.release_id, *pointer)
            if meta and hashlib.sha256(data).hexdigest() != meta["sha256"]:
                raise StorageUnavailable(f"release {rel.release_id}: {name} fails its digest check")
            files[name] = data
        return files

    def _read_lfs(self, release_id: str, oid: str, size: int) -> bytes:
        path = self.lfs_path(oid)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise Conflict(
                f"release {release_id} is not restorable: LFS object {oid} was pruned",
                release_id=release_id,
            ) from None
        if len(data) != size:
            raise StorageUnavailable(f"LFS object {oid} has {len(data)} bytes, expected {size}")
        return data

    def materialize(self, release_id: str, dest: str | os.PathLike | None = None) -> Path:
        """The release's files in a directory: the per-release cache, or copied into ``dest``.

        The cache entry ``<work_dir>/releases/<sha>`` is written once (atomic rename) and
        reused by every later call for the same release.
        """
        sha = normalize_release_id(release_id)
        cache_root = self.work_dir / "releases"
        cache = cache_root / sha
        if not cache.is_dir():
            files = self.read_files(sha)
            tmp = cache_root / f".tmp-{sha}-{uuid.uuid4().hex}"
            for name, data in files.items():
                target = tmp / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            tmp.mkdir(parents=True, exist_ok=True)  # an empty release is still a directory
            try:
                os.rename(tmp, cache)
            except OSError:  # a concurrent call installed it first
                shutil.rmtree(tmp, ignore_errors=True)
        if dest is None:
            return cache
        dest = Path(dest)
        shutil.copytree(cache, dest, dirs_exist_ok=True)
        return dest

    # ------------------------------------------------------------------ writing

    def _write_blobs(self, writer: ObjectWriter,
                     files: Mapping[str, FileValue]) -> tuple[dict[str, str], dict[str, dict]]:
        """Store every file; return path -> blob sha and path -> {size, sha256, lfs}.

        Weight files go to the LFS store and are committed as the pointer git-lfs would write (an empty one
        stays a plain empty blob, as git-lfs leaves it); the sha256 is taken while the bytes are written."""
        blobs: dict[str, str] = {}
        meta: dict[str, dict] = {}
        for name, value in sorted(files.items()):
            validate_path(name)
            data, src = self._file_value(name, value)
            if src is not None and (not is_lfs_path(name) or src.stat().st_size == 0):
                data, src = src.read_bytes(), None
            if is_lfs_path(name) and (src is not None or len(data) > 0):
                oid, size = writer.lfs_file(src) if src is not None else writer.lfs_bytes(data)
                meta[name] = {"size": size, "sha256": oid, "lfs": True}
                blobs[name] = writer.blob(writer.pointer(oid, size))
                continue
            meta[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "lfs": False}
            blobs[name] = writer.blob(data)
        blobs[ATTRIBUTES] = writer.blob(GITATTRIBUTES)
        return blobs, meta

    @staticmethod
    def _file_value(name: str, value: FileValue) -> tuple[bytes | None, Path | None]:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value), None
        if isinstance(value, (str, os.PathLike)):
            path = Path(value)
            if not path.is_file():
                raise ValidationFailed(f"{name}: {path} is not a file")
            return None, path
        raise ValidationFailed(f"{name}: file values must be bytes or a path")

    @staticmethod
    def _mktree(writer: ObjectWriter, blobs: dict[str, str]) -> str:
        """Build nested trees bottom-up from path -> blob sha."""
        root: dict = {}
        for name, sha in blobs.items():
            node = root
            *dirs, leaf = name.split("/")
            for d in dirs:
                node = node.setdefault(d, {})
                if not isinstance(node, dict):
                    raise ValidationFailed(f"{name}: a file and a directory share a path")
            if leaf in node:
                raise ValidationFailed(f"{name}: a file and a directory share a path")
            node[leaf] = sha

        def write(node: dict) -> str:
            return writer.tree({entry: (True, write(value)) if isinstance(value, dict) else (False, value)
                                for entry, value in node.items()})

        return write(root)

    def _commit(self, tree: str, parent: str | None, message: str) -> str:
        args = ["commit-tree", tree, "-m", message]
        if parent:
            args += ["-p", parent]
        return self.git.out(*args)

    def _check_head(self, scenario: str, expected: str | None, snap: dict[str, str]) -> None:
        current = snap.get(scenario_ref(scenario))
        if current != expected:
            raise Conflict(
                f"scenario {scenario!r} head is {current or 'unset'}, expected {expected or 'unset'}",
                scenario=scenario,
                expected=expected,
                actual=current,
            )

    def _stage_manifest(self, writer: ObjectWriter, blobs: dict[str, str], manifest: dict, parent: str | None) -> str:
        text = dumps_manifest(manifest)
        tree = self._mktree(writer, {**blobs, MANIFEST: writer.blob(text)})
        message = f"reef {manifest['operation']}: {manifest['scenario']}\n\ncontent {manifest['content_id']}"
        sha = writer.commit(tree, parent, message, int(time.time()))
        writer.sync()  # durable before any ref names the commit
        self._manifest_cache[sha] = json.loads(text)
        self._refs.upload_lfs({m["sha256"] for m in manifest["files"].values() if m["lfs"]})
        self._refs.transaction([RefUpdate(STAGED + sha, sha, ZERO)])
        return sha

    def stage(
        self,
        scenario: str,
        files: Mapping[str, FileValue],
        *,
        expected_parent: str | None,
        operation: str = "training",
        source: dict | None = None,
        metrics: dict | None = None,
        evaluation: dict | None = None,
        log_row: dict | None = None,
    ) -> Release:
        """Write a release commit on top of ``expected_parent`` without serving it.

        The commit holds ``files`` (bytes or paths to files), ``.gitattributes`` and
        ``reef-artifact.json`` = {scenario, content_id, parent_release_id, operation, source,
        metrics, evaluation, gate (alias of evaluation), created_at, files, commit}; ``commit``
        is the commit-log row the caller is about to append (``log_row``), used by recovery.
        Raises Conflict when the scenario head is no longer ``expected_parent``.
        """
        validate_scenario(scenario)
        if operation not in OPERATIONS:
            raise ValidationFailed(f"operation must be one of {', '.join(OPERATIONS)}")
        if not isinstance(files, Mapping):
            raise ValidationFailed("files must be a mapping of path -> bytes")
        parent = normalize_release_id(expected_parent) if expected_parent else None
        evaluation = _jsonable(evaluation, "evaluation")
        with self._flock(fcntl.LOCK_SH):
            snap = self._snapshot()
            self._check_head(scenario, parent, snap)
            with ObjectWriter(self.git_dir, self.media_dir) as writer:  # objects in process, no git child
                blobs, meta = self._write_blobs(writer, files)
                manifest = {
                    "schema": 1,
                    "scenario": scenario,
                    "content_id": content_id_of(meta),
                    "parent_release_id": parent,
                    "operation": operation,
                    "source": _jsonable(source, "source") or {"kind": operation},
                    "metrics": _jsonable(metrics, "metrics") or {},
                    "evaluation": evaluation,
                    "gate": evaluation,
                    "created_at": _iso(_now()),
                    "files": meta,
                    "commit": _jsonable(log_row, "log_row"),
                }
                sha = self._stage_manifest(writer, blobs, manifest, parent)
        return self._get(sha, {**snap, STAGED + sha: sha})  # what the transaction just made

    def stage_republish(
        self,
        scenario: str,
        release_id: str,
        *,
        expected_parent: str | None,
        operation: str,
        log_row: dict | None = None,
        note: dict | None = None,
    ) -> Release:
        """Stage the content of an earlier release as a new release (``rollback``/``promote``/``restore``).

        ``rollback`` and ``restore`` (putting back what still serves after a release failed to
        activate) need a release of the scenario's chain, ``promote`` a pending (held) one; either
        must be restorable (Conflict otherwise; NotFound for an unknown id). ``note`` adds fields to
        the manifest's ``source`` (a restore names the release that failed and its error).
        """
        if operation not in ("rollback", "promote", "restore"):
            raise ValidationFailed("republish operation must be 'rollback', 'promote' or 'restore'")
        target = self.get(release_id)
        if target.scenario != scenario:
            raise NotFound(f"release {target.release_id} is not a release of scenario {scenario!r}")
        if operation in ("rollback", "restore") and target.state != "chain":
            raise Conflict(
                f"release {target.release_id} is {'pending: promote it' if target.pending else target.state}, "
                "not in the scenario's release chain"
            )
        if operation == "promote" and not target.pending:
            raise Conflict(f"release {target.release_id} is not pending review")
        if not target.restorable:
            raise Conflict(f"release {target.release_id} is not restorable", release_id=target.release_id)
        parent = normalize_release_id(expected_parent) if expected_parent else None
        with self._flock(fcntl.LOCK_SH):
            snap = self._snapshot()
            self._check_head(scenario, parent, snap)
            if not self._restorable(target.release_id, {"files": target.files}, snap):
                raise Conflict(f"release {target.release_id} is not restorable")
            manifest = {
                "schema": 1,
                "scenario": scenario,
                "content_id": target.content_id,
                "parent_release_id": parent,
                "operation": operation,
                "source": {**_jsonable(note or {}, "note"), "kind": operation, "release_id": target.release_id,
                           "content_id": target.content_id},
                "metrics": target.metrics,
                "evaluation": target.evaluation,
                "gate": target.evaluation,
                "created_at": _iso(_now()),
                "files": target.files,
                "commit": _jsonable(log_row, "log_row"),
            }
            sha = self._stage_tree(manifest, parent)
        return self._get(sha, self._snapshot())

    def _stage_tree(self, manifest: dict, parent: str | None) -> str:
        # Reuse the source release's top-level tree entries as they are; swap only the manifest.
        manifest_blob = self.git.out("hash-object", "-w", "--stdin", input=dumps_manifest(manifest))
        listing = self.git.run("ls-tree", "-z", manifest["source"]["release_id"]).stdout
        lines = []
        for item in listing.split(b"\0"):
            if not item:
                continue
            meta, _, name = item.partition(b"\t")
            if name.decode() == MANIFEST:
                continue
            lines.append(meta + b"\t" + name + b"\0")
        lines.append(f"100644 blob {manifest_blob}\t{MANIFEST}\0".encode())
        tree = self.git.out("mktree", "-z", input=b"".join(lines))
        message = f"reef {manifest['operation']}: {manifest['scenario']}\n\ncontent {manifest['content_id']}"
        sha = self._commit(tree, parent, message)
        self._refs.transaction([RefUpdate(STAGED + sha, sha, ZERO)])
        return sha

    def advance(self, scenario: str, release_id: str, *, expected_head: str | None) -> Release:
        """Make a staged release the scenario head by compare-and-swap from ``expected_head``.

        The release must have been staged on ``expected_head``. Idempotent: advancing the
        release that is already the head returns it. A promote also moves the promoted
        release from ``refs/reef/releases/`` to ``refs/reef/promoted/`` in the same transaction.
        """
        sha = normalize_release_id(release_id)
        expected = normalize_release_id(expected_head) if expected_head else None
        snap = self._snapshot()
        ref = scenario_ref(scenario)
        if snap.get(ref) == sha:
            return self._get(sha, snap)
        manifest = self._manifests([sha])[sha]
        if manifest is None or STAGED + sha not in snap:
            raise NotFound(f"release {sha} is not staged")
        if manifest["scenario"] != scenario:
            raise ValidationFailed(f"release {sha} belongs to scenario {manifest['scenario']!r}")
        if manifest.get("parent_release_id") != expected:
            raise Conflict(
                f"release {sha} was built on {manifest.get('parent_release_id') or 'nothing'}, "
                f"not on {expected or 'nothing'}"
            )
        updates = [
            RefUpdate(ref, sha, expected or ZERO),
            RefUpdate(STAGED + sha, ZERO, sha),
        ]
        promoted = (manifest.get("source") or {}).get("release_id")
        if manifest["operation"] == "promote" and HELD + str(promoted) in snap:
            updates += [
                RefUpdate(HELD + promoted, ZERO, promoted),
                RefUpdate(PROMOTED + promoted, promoted, ZERO),
            ]
        self._advance_refs(updates, sha)
        after = dict(snap)  # what the transaction just made
        for u in updates:
            if u.new == ZERO:
                after.pop(u.ref, None)
            else:
                after[u.ref] = u.new
        return self._get(sha, after)

    def _advance_refs(self, updates: list[RefUpdate], sha: str) -> None:
        """Apply the head move and move the global head with it, in one local transaction (one ref fsync round)
        when that goes through; otherwise as before, the move first and the global head after it, best effort."""
        if not self.is_remote:
            try:
                self._refs.transaction([*updates, RefUpdate(HEAD_REF, sha, None)], attempts=1)
                return
            except StorageUnavailable:  # e.g. the global head's lock stayed busy: it must not stop the move
                pass
        self._refs.transaction(updates)
        self._move_global_head(sha)

    def _move_global_head(self, sha: str) -> None:
        # Last writer wins across scenarios; a failure here never undoes the scenario move.
        try:
            self._refs.transaction([RefUpdate(HEAD_REF, sha, None)])
        except Exception as exc:  # noqa: BLE001 - best effort by design
            log.warning("could not move %s to %s: %s", HEAD_REF, sha, exc)

    def hold(self, release_id: str) -> Release:
        """Keep a staged release for review (``pending``) without moving any head."""
        sha = normalize_release_id(release_id)
        snap = self._snapshot()
        if HELD + sha in snap:
            return self._get(sha, snap)
        if STAGED + sha not in snap:
            raise NotFound(f"release {sha} is not staged")
        self._refs.transaction([RefUpdate(STAGED + sha, ZERO, sha), RefUpdate(HELD + sha, sha, ZERO)])
        return self.get(sha)

    def discard(self, release_id: str) -> bool:
        """Drop a staged release (it becomes an unreachable commit); False if it was not staged."""
        sha = normalize_release_id(release_id)
        snap = self._snapshot()
        if STAGED + sha not in snap:
            return False
        self._refs.transaction([RefUpdate(STAGED + sha, ZERO, sha)])
        return True

    def archive(self, scenario: str, *, expected_head: str | None = None) -> str:
        """Move the scenario ref to ``refs/reef/archived/<b64>/<timestamp>``; return that ref.

        Nothing is deleted: the chain stays reachable from the archived ref.
        """
        snap = self._snapshot()
        ref = scenario_ref(scenario)
        head = snap.get(ref)
        if head is None:
            raise NotFound(f"unknown scenario {scenario!r}")
        if expected_head is not None and normalize_release_id(expected_head) != head:
            raise Conflict(f"scenario {scenario!r} head is {head}, expected {expected_head}")
        target = f"{ARCHIVED}{scenario_key(scenario)}/{_now().strftime('%Y%m%dT%H%M%S%fZ')}"
        self._refs.transaction([RefUpdate(target, head, ZERO), RefUpdate(ref, ZERO, head)])
        return target

    # ------------------------------------------------------------------ maintenance (GC)

    def all_releases(self) -> list[Release]:
        """Every release reachable from a ``refs/reef/`` ref: chains, archived, held, staged."""
        snap = self._snapshot()
        states: dict[str, str] = {}
        for prefix, state in ((STAGED, "staged"), (HELD, "held"), (PROMOTED, "promoted")):
            for ref, sha in snap.items():
                if ref.startswith(prefix):
                    states[sha] = state
        for prefix, state in ((SCENARIOS, "chain"), (ARCHIVED, "archived")):
            for ref, sha in snap.items():
                if ref.startswith(prefix):
                    for commit in self.git.out("rev-list", "--first-parent", sha).split():
                        states.setdefault(commit, state)
        manifests = self._manifests(list(states))
        return [self._release(s, m, snap, states[s]) for s, m in manifests.items() if m]

    def lfs_objects(self) -> dict[str, Path]:
        """Every LFS object in this repository's store: oid -> path."""
        if not self.media_dir.is_dir():
            return {}
        return {p.name: p for p in self.media_dir.glob("??/??/*") if len(p.name) == 64}

    def mark_pruned(self, release_ids: list[str]) -> None:
        """Record (``refs/reef/pruned/<sha>``) that these releases lost their LFS weights."""
        updates = [RefUpdate(PRUNED + normalize_release_id(r), normalize_release_id(r), None) for r in release_ids]
        if updates:
            self._refs.transaction(updates)

