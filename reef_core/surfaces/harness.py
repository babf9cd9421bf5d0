"""The harness surface: a release is a tree of UTF-8 text files (prompts, rules, skills).

What a harness release may contain is checked here, once, for every way a tree enters Reef
(a trainer's candidate, a restore from the artifact store, an HTTP read):

* paths (:func:`validate_harness_path`): relative and ``/``-separated; no leading or trailing
  whitespace; no empty, ``.`` or ``..``
  segment; no ``.git`` segment; no backslash, colon (drive letters, alternate streams), percent
  sign (a path is matched literally and never decoded a second time), NUL or other control
  character; not one of the store's reserved names;
* content (:func:`validate_tree`): text only (strict UTF-8 without NUL), at most
  ``max_file_bytes`` per file, ``max_total_bytes`` and ``max_files`` per tree.

:class:`HarnessSurface` keeps the tree serving each scenario in memory. Clients that pull
(``GET /reef/harness``) read it; with ``inject: system`` the surface also writes the configured
files (``system_files``, default ``system_prompt.md``) into the system prompt of every inference
of the scenario, so a client that never pulls still runs the current release. Injection never
duplicates: a system prompt that already starts with the harness text is left as it is.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reef_core.commit.release import RESERVED
from reef_core.errors import ConfigError, ValidationFailed
from reef_core.surfaces.base import Surface
from reef_core.wire import RELEASE_HEADER  # noqa: F401 - a harness answer names its release

log = logging.getLogger("reef.surfaces.harness")

MAX_PATH_LENGTH = 512
DEFAULT_MAX_FILE_BYTES = 1 << 20
DEFAULT_MAX_TOTAL_BYTES = 8 << 20
DEFAULT_MAX_FILES = 1000
DEFAULT_SYSTEM_FILES = ("system_prompt.md",)
#: Between the harness text and the client's own system prompt when injection extends it.
SEPARATOR = "\n\n"

_FORBIDDEN_CHARS = re.compile(r"[\x00-\x1f\x7f\\:%]")


def validate_harness_path(path: Any) -> str:
    """Return ``path`` if it may name a file of a harness tree, else raise ``ValidationFailed``."""
    if not isinstance(path, str) or not path:
        raise ValidationFailed("harness file paths must be non-empty strings")
    if len(path) > MAX_PATH_LENGTH:
        raise ValidationFailed(f"harness file path is longer than {MAX_PATH_LENGTH} characters")
    shown = path if len(path) <= 80 else path[:77] + "..."
    if path.startswith("/"):
        raise ValidationFailed(f"harness file path {shown!r} is absolute")
    if path != path.strip():  # the install script reads paths with `read`, which trims them: no client could install it
        raise ValidationFailed(f"harness file path {shown!r} has leading or trailing whitespace")
    if _FORBIDDEN_CHARS.search(path):
        raise ValidationFailed(f"harness file path {shown!r} contains a forbidden character "
                               "(backslash, colon, percent sign or control character)")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise ValidationFailed(f"harness file path {shown!r} has an empty, '.' or '..' segment")
        if part.lower() == ".git":
            raise ValidationFailed(f"harness file path {shown!r} has a '.git' segment")
    if path in RESERVED:
        raise ValidationFailed(f"{path!r} is reserved for the release manifest and attributes")
    return path


def _text_of(path: str, value: Any) -> str:
    if isinstance(value, str):
        text = value
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValidationFailed(f"{path}: not encodable as UTF-8 text") from None
    elif isinstance(value, (bytes, bytearray, memoryview)):
        try:
            text = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ValidationFailed(f"{path}: harness files must be UTF-8 text") from None
    else:
        raise ValidationFailed(f"{path}: harness files must be text, not {type(value).__name__}")
    if "\x00" in text:
        raise ValidationFailed(f"{path}: harness files must be text (NUL byte found)")
    return text


def validate_tree(files: Mapping[str, Any], *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                  max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES, max_files: int = DEFAULT_MAX_FILES) -> dict[str, str]:
    """Check a harness tree (path -> str or UTF-8 bytes) and return it as path -> text, sorted by path."""
    if not isinstance(files, Mapping):
        raise ValidationFailed("a harness tree must be a mapping of path -> text")
    if len(files) > max_files:
        raise ValidationFailed(f"a harness tree holds at most {max_files} files, got {len(files)}")
    tree: dict[str, str] = {}
    total = 0
    for path in sorted(files, key=str):
        validate_harness_path(path)
        text = _text_of(path, files[path])
        size = len(text.encode("utf-8"))
        if size > max_file_bytes:
            raise ValidationFailed(f"{path}: {size} bytes exceeds the per-file cap of {max_file_bytes}")
        total += size
        if total > max_total_bytes:
            raise ValidationFailed(f"the harness tree exceeds the total cap of {max_total_bytes} bytes")
        tree[path] = text
    # A path that is both a file and a directory cannot be materialised (git refuses it too).
    for path in tree:
        if any(p in tree for p in _parents(path)):
            raise ValidationFailed(f"{path}: a file and a directory share a path")
    return tree


def _parents(path: str) -> Iterable[str]:
    parts = path.split("/")
    for i in range(1, len(parts)):
        yield "/".join(parts[:i])


def encode_tree(tree: Mapping[str, str]) -> dict[str, bytes]:
    """path -> UTF-8 bytes, the form a release stores."""
    return {path: text.encode("utf-8") for path, text in tree.items()}


def render_system_prompt(tree: Mapping[str, str], paths: Iterable[str] = DEFAULT_SYSTEM_FILES) -> str:
    """The harness text of the system prompt: the listed files present in ``tree``, in order, joined by a
    blank line. The same rule serves injection and trainers that run tasks with a candidate tree."""
    return SEPARATOR.join(tree[p] for p in paths if p in tree and tree[p])


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict) and content[0].get("type") == "text":
        return content[0].get("text") if isinstance(content[0].get("text"), str) else None
    return None


def _merged(existing: Any, text: str, mode: str) -> Any:
    """``existing`` system content (string or typed parts) with ``text`` set or put in front."""
    if mode == "replace" or existing is None or existing == "" or existing == []:
        return text
    head = _content_text(existing)
    if head is not None and head.startswith(text):
        return existing  # the client already sends this harness text (it pulled the tree)
    if isinstance(existing, str):
        return text + SEPARATOR + existing
    if isinstance(existing, list):
        return [{"type": "text", "text": text}, *existing]
    return text


def inject_system(dialect: str, body: dict, text: str, mode: str = "extend") -> dict:
    """A copy of a chat request ``body`` whose system prompt carries ``text``.

    ``mode="extend"``: an absent system prompt is set, a present one gets ``text`` in front of it
    (unless it already starts with it); ``mode="replace"``: the system prompt becomes ``text``.
    OpenAI bodies use a leading ``system`` (or ``developer``) message, Anthropic bodies the
    top-level ``system`` field (a string or text blocks).
    """
    if mode not in ("extend", "replace"):
        raise ValueError(f"unknown injection mode {mode!r}")
    if not text:
        return body
    out = dict(body)
    if dialect == "anthropic":
        out["system"] = copy.deepcopy(_merged(body.get("system"), text, mode))
        return out
    if dialect != "openai":
        raise ValidationFailed(f"cannot inject a system prompt into a {dialect!r} request")
    messages = body.get("messages") or []
    if not isinstance(messages, list):
        raise ValidationFailed("messages must be a list", param="messages")
    messages = list(messages)
    if messages and isinstance(messages[0], dict) and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = copy.deepcopy(_merged(first.get("content"), text, mode))
        messages[0] = first
    else:
        messages.insert(0, {"role": "system", "content": text})
    out["messages"] = messages
    return out


@dataclass(frozen=True)
class ServedTree:
    """What serves a scenario: the release id (None for a tree not yet published) and its files."""

    release_id: str | None
    files: Mapping[str, str]


def _option_list(value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return default
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


class HarnessSurface(Surface):
    """Serves harness releases (text trees) per scenario; see the module docstring.

    Options (``recipe.surface_options``):

    ``inject``           ``none`` (default) or ``system``: write the harness text into every request's
                         system prompt.
    ``system_files``     files whose text forms the system prompt (default ``[system_prompt.md]``);
                         ``system_file`` is accepted for one file.
    ``inject_mode``      ``extend`` (default: prepend to the client's own system prompt) or ``replace``.
    ``max_file_bytes``, ``max_total_bytes``, ``max_files``: caps of :func:`validate_tree`.

    ``artifacts`` (the deployment's artifact store, ``ports.artifacts``), when given, lets the
    surface load a scenario's head on first use, so a restarted server serves its last release
    before the learner re-activates it.
    """

    kind = "harness"

    def __init__(self, artifacts: Any = None, options: Mapping[str, Any] | None = None):
        opts = dict(options or {})
        known = {"inject", "system_files", "system_file", "inject_mode", "max_file_bytes", "max_total_bytes",
                 "max_files"}
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ConfigError(f"harness surface has no option {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        self.artifacts = artifacts
        self.inject = str(opts.get("inject") or "none")
        if self.inject not in ("none", "system"):
            raise ConfigError(f"harness surface: inject must be 'none' or 'system', not {self.inject!r}")
        self.inject_mode = str(opts.get("inject_mode") or "extend")
        if self.inject_mode not in ("extend", "replace"):
            raise ConfigError(f"harness surface: inject_mode must be 'extend' or 'replace', not {self.inject_mode!r}")
        files = opts.get("system_files", opts.get("system_file"))
        self.system_files = _option_list(files, DEFAULT_SYSTEM_FILES)
        for path in self.system_files:
            try:
                validate_harness_path(path)
            except ValidationFailed as exc:
                raise ConfigError(f"harness surface: system_files: {exc.message}") from None
        self.limits = {
            "max_file_bytes": int(opts.get("max_file_bytes") or DEFAULT_MAX_FILE_BYTES),
            "max_total_bytes": int(opts.get("max_total_bytes") or DEFAULT_MAX_TOTAL_BYTES),
            "max_files": int(opts.get("max_files") or DEFAULT_MAX_FILES),
        }
        self._lock = threading.RLock()
        self._served: dict[str, ServedTree] = {}
        self._looked_up: set[str] = set()
        self._pinned: dict[str, dict[str, str]] = {}

    # -- validation ----------------------------------------------------------------------------------

    def validate(self, files: Mapping[str, Any]) -> None:
        validate_tree(files, **self.limits)

    def checked(self, files: Mapping[str, Any]) -> dict[str, str]:
        """``files`` validated and decoded (path -> text)."""
        return validate_tree(files, **self.limits)

    # -- activation ----------------------------------------------------------------------------------

    def activate(self, scenario: str, release_id: str | None, payload: Any = None,
                 files: Callable[[], Mapping[str, bytes]] | None = None) -> None:
        """Serve ``release_id`` for ``scenario`` from the next request on.

        The tree comes from ``payload`` (a path -> text mapping, e.g. a trainer's candidate) or, when
        there is none, from ``files()`` (the release read back from the artifact store). With neither,
        and no release id, the scenario stops serving a tree.
        """
        if payload is not None:
            if not isinstance(payload, Mapping):
                raise ValidationFailed("a harness payload must be a mapping of path -> text")
            tree = self.checked(payload)
        elif files is not None:
            tree = self.checked(files())
        elif release_id is None:
            with self._lock:
                self._served.pop(scenario, None)
                self._looked_up.add(scenario)
            return
        else:
            tree = self._read_release(release_id)
        with self._lock:
            self._served[scenario] = ServedTree(release_id, dict(tree))
            self._looked_up.add(scenario)
        log.info("harness %s now serves release %s (%d files)", scenario, release_id, len(tree))

    def restore(self, scenario: str) -> str | None:
        """Load the scenario's head from the artifact store and serve it; return its release id."""
        store = self.artifacts
        if store is None:
            return None
        head = store.head(scenario)
        if head is None:
            with self._lock:
                self._looked_up.add(scenario)
            return None
        self.activate(scenario, head.release_id, files=lambda: store.read_files(head.release_id))
        return head.release_id

    def _read_release(self, release_id: str) -> dict[str, str]:
        store = self.artifacts
        if store is None:
            raise ValidationFailed(f"release {release_id} cannot be loaded: the surface has no artifact store")
        return self.checked(store.read_files(release_id))

    # -- reading -------------------------------------------------------------------------------------

    def current(self, scenario: str) -> ServedTree | None:
        """What serves ``scenario`` now (loaded from the artifact store on first use), or None."""
        with self._lock:
            served = self._served.get(scenario)
            if served is not None or scenario in self._looked_up:
                return served
        try:
            self.restore(scenario)
        except Exception:  # noqa: BLE001 - a broken store must not break inference; retried next call
            log.exception("could not restore the harness of scenario %s", scenario)
            return None
        with self._lock:
            return self._served.get(scenario)

    def serving_version(self, scenario: str) -> str | None:
        served = self.current(scenario)
        return served.release_id if served else None

    def system_text(self, scenario: str) -> str:
        """The harness text injected into the scenario's system prompt ('' when none)."""
        served = self.current(scenario)
        return render_system_prompt(served.files, self.system_files) if served else ""

    # -- request path --------------------------------------------------------------------------------

    def prepare_request(self, scenario: str, dialect: str, body: dict) -> tuple[dict, str | None]:
        served = self.current(scenario)
        if served is None:
            return body, None
        if self.inject == "system":
            text = render_system_prompt(served.files, self.system_files)
            if text:
                body = inject_system(dialect, body, text, self.inject_mode)
        return body, served.release_id

    #: A request may be served by a release other than the head (``x-reef-release``: :meth:`prepare_pinned`).
    pins_releases = True
    #: Pinned trees kept in memory (release id -> files): a pinned alias is asked for again and again.
    PINNED_CACHE = 8

    def prepare_pinned(self, scenario: str, dialect: str, body: dict, release_id: str) -> tuple[dict, str]:
        """:meth:`prepare_request` with the files of ``release_id`` (a release of the scenario the caller checked)
        instead of the head's; nothing that serves changes."""
        with self._lock:
            pinned = self._pinned
            files = pinned.get(release_id)
        if files is None:
            files = self._read_release(release_id)
            with self._lock:
                if len(pinned) >= self.PINNED_CACHE:
                    pinned.pop(next(iter(pinned)))
                pinned[release_id] = files
        if self.inject == "system":
            text = render_system_prompt(files, self.system_files)
            if text:
                body = inject_system(dialect, body, text, self.inject_mode)
        return body, release_id

    def response_headers(self, scenario: str, release_id: str | None) -> dict[str, str]:
        if release_id is None:
            release_id = self.serving_version(scenario)
        return {RELEASE_HEADER: release_id} if release_id else {}
