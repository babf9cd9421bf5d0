"""The skill surface: a release is a pool of skills that every agent of a scenario shares.

Layout: one file per skill, ``skills/<slug>/SKILL.md``, and nothing else. A SKILL.md starts with a YAML
front matter block (``---`` lines) holding exactly ``name`` (equal to the slug), ``description`` (what the
skill is for and when not to use it: it is all an agent sees before reading the skill) and ``category``;
the markdown body after it is the skill itself.

Validation (:func:`validate_pool`, on top of the harness tree rules of :mod:`.harness`): slugs are lowercase
``a-z0-9`` words joined by single hyphens (at most 64 characters); each file holds at most
``max_skill_bytes``; at most ``max_skills`` skills; descriptions at most ``max_description_chars``; no
credential-shaped literal anywhere (API keys, tokens, private keys: a pool is served to every agent and
kept in git forever); no text that forges the catalog markers. A trainer's candidate may not remove a skill
that the serving release has (:meth:`SkillSurface.validate_successor`).

Delivery: the catalog (one line per skill: slug, category, description) is written server-side into the
system prompt of every inference of the scenario, in the request's own dialect (OpenAI ``messages``,
Anthropic ``system``; streamed or not: the request is rewritten before the engine sees it). The catalog is
wrapped in :data:`CATALOG_OPEN` / :data:`CATALOG_CLOSE`; a request whose system prompt already holds the
opening marker is left alone, so the catalog is never there twice. It is capped at ``catalog_max_bytes``
(skills past the cap are counted on a last line, not listed). A skill's body is served on demand by
``GET /reef/skills/{slug}``, and the whole tree by ``GET /reef/harness``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from reef_core.errors import ConfigError, ValidationFailed
from reef_core.surfaces.harness import HarnessSurface, ServedTree, inject_system, validate_tree

SKILLS_DIR = "skills"
SKILL_FILE = "SKILL.md"
CATALOG_OPEN = "<reef-skills>"
CATALOG_CLOSE = "</reef-skills>"
MAX_SLUG_LENGTH = 64
MAX_CATEGORY_LENGTH = 64
DEFAULT_MAX_SKILLS = 200
DEFAULT_MAX_SKILL_BYTES = 32 * 1024
DEFAULT_MAX_DESCRIPTION_CHARS = 600
DEFAULT_CATALOG_MAX_BYTES = 8 * 1024
MIN_CATALOG_MAX_BYTES = 512
FRONT_MATTER_KEYS = ("name", "description", "category")

_SLUG = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_FRONT = re.compile(r"\A---[ \t]*\n(.*?)\n---[ \t]*(?:\n|\Z)", re.S)
_FORGED = re.compile(r"</?reef-skills\b", re.I)
#: Literals shaped like credentials (provider keys, cloud keys, tokens, private keys, key assignments).
_CREDENTIALS = [
    ("an OpenAI/Anthropic-style API key", re.compile(r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{20,}")),
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("a bearer token", re.compile(r"\bBearer\s+[A-Za-z0-9._~+/=-]{20,}")),
    ("a secret assignment", re.compile(
        r"(?i)\b(?:api[_-]?key|secret(?:[_-]?key)?|access[_-]?token|auth[_-]?token|password|passwd)\b"
        r"[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9_./+=-]{12,}")),
]


@dataclass(frozen=True)
class Skill:
    """One skill of a pool (the parsed ``skills/<slug>/SKILL.md``)."""

    slug: str
    description: str
    category: str
    body: str

    @property
    def name(self) -> str:
        return self.slug

    @property
    def path(self) -> str:
        return skill_path(self.slug)

    def to_dict(self) -> dict:
        return {"slug": self.slug, "name": self.slug, "description": self.description, "category": self.category,
                "path": self.path}


def skill_path(slug: str) -> str:
    """Where the skill ``slug`` lives in a release."""
    return f"{SKILLS_DIR}/{slug}/{SKILL_FILE}"


def validate_slug(slug: Any, what: str = "skill slug") -> str:
    """Return ``slug`` if it may name a skill, else raise ``ValidationFailed``."""
    if not isinstance(slug, str) or not slug:
        raise ValidationFailed(f"{what} must be a non-empty string")
    if len(slug) > MAX_SLUG_LENGTH or not _SLUG.fullmatch(slug):
        shown = slug if len(slug) <= 80 else slug[:77] + "..."
        raise ValidationFailed(f"{what} {shown!r} must be lowercase letters and digits joined by single hyphens "
                               f"(at most {MAX_SLUG_LENGTH} characters)")
    return slug


def credential_problem(text: str) -> str | None:
    """What credential-shaped literal ``text`` holds (a description), or ``None``."""
    for what, pattern in _CREDENTIALS:
        if pattern.search(text):
            return what
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def parse_skill(slug: str, text: str, *, max_description_chars: int = DEFAULT_MAX_DESCRIPTION_CHARS) -> Skill:
    """The skill ``text`` (a SKILL.md) describes, checked; ``ValidationFailed`` names what is wrong."""
    where = skill_path(slug)
    match = _FRONT.match(text)
    if match is None:
        raise ValidationFailed(f"{where}: must start with a '---' front matter block (name, description, category)")
    import yaml  # here: a server that never reads a skill does not load PyYAML

    try:
        front = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        raise ValidationFailed(f"{where}: the front matter is not valid YAML") from None
    if not isinstance(front, dict):
        raise ValidationFailed(f"{where}: the front matter must be a mapping")
    unknown = sorted(str(k) for k in front if k not in FRONT_MATTER_KEYS)
    if unknown:
        raise ValidationFailed(f"{where}: unknown front matter key(s) {', '.join(unknown)} "
                               f"(allowed: {', '.join(FRONT_MATTER_KEYS)})")
    for key in FRONT_MATTER_KEYS:
        if not isinstance(front.get(key), str) or not front[key].strip():
            raise ValidationFailed(f"{where}: front matter {key} must be non-empty text")
    if front["name"] != slug:
        raise ValidationFailed(f"{where}: name {front['name']!r} must equal the skill's directory {slug!r}")
    description = _one_line(front["description"])
    if len(description) > max_description_chars:
        raise ValidationFailed(f"{where}: the description has {len(description)} characters "
                               f"(at most {max_description_chars})")
    category = front["category"].strip()
    if len(category) > MAX_CATEGORY_LENGTH or not _SLUG.fullmatch(category):
        raise ValidationFailed(f"{where}: category {category!r} must be a lowercase slug")
    body = text[match.end():].strip("\n")
    if not body.strip():
        raise ValidationFailed(f"{where}: the skill has no body")
    return Skill(slug=slug, description=description, category=category, body=body)


def render_skill(skill: Skill) -> str:
    """The SKILL.md text of ``skill`` (what :func:`parse_skill` reads back)."""
    import yaml

    front = yaml.safe_dump({"name": skill.slug, "description": _one_line(skill.description),
                            "category": skill.category}, sort_keys=False, allow_unicode=True, width=1 << 20)
    return f"---\n{front}---\n\n{skill.body.strip()}\n"


def validate_pool(files: Mapping[str, Any], *, max_skills: int = DEFAULT_MAX_SKILLS,
                  max_skill_bytes: int = DEFAULT_MAX_SKILL_BYTES,
                  max_description_chars: int = DEFAULT_MAX_DESCRIPTION_CHARS,
                  **tree_limits: int) -> dict[str, Skill]:
    """Check a skill release (path -> text or UTF-8 bytes); return its skills by slug, sorted."""
    tree = validate_tree(files, **tree_limits)
    skills: dict[str, Skill] = {}
    for path, text in tree.items():
        parts = path.split("/")
        if len(parts) != 3 or parts[0] != SKILLS_DIR or parts[2] != SKILL_FILE:
            raise ValidationFailed(f"{path}: a skill release holds only {SKILLS_DIR}/<slug>/{SKILL_FILE} files")
        slug = validate_slug(parts[1])
        size = len(text.encode("utf-8"))
        if size > max_skill_bytes:
            raise ValidationFailed(f"{path}: {size} bytes exceeds the per-skill cap of {max_skill_bytes}")
        found = credential_problem(text)
        if found is not None:
            raise ValidationFailed(f"{path}: holds what looks like {found}; skills are served to every agent, "
                                   "so credentials never belong in them")
        if _FORGED.search(text):
            raise ValidationFailed(f"{path}: must not contain the catalog markers {CATALOG_OPEN} / {CATALOG_CLOSE}")
        skills[slug] = parse_skill(slug, text, max_description_chars=max_description_chars)
    if len(skills) > max_skills:
        raise ValidationFailed(f"a skill pool holds at most {max_skills} skills, got {len(skills)}")
    return skills


def pool_files(skills: Mapping[str, Skill] | list[Skill]) -> dict[str, str]:
    """The release files (path -> text) of a pool."""
    values = skills.values() if isinstance(skills, Mapping) else skills
    return {skill_path(s.slug): render_skill(s) for s in sorted(values, key=lambda s: s.slug)}


def render_catalog(skills: Mapping[str, Skill], max_bytes: int = DEFAULT_CATALOG_MAX_BYTES) -> str:
    """The catalog injected into requests: one line per skill (by category, then slug), at most ``max_bytes``."""
    if not skills:
        return ""
    head = (f"{CATALOG_OPEN}\nShared skills of this deployment. When one fits your task, read its full text before "
            "acting (GET /reef/skills/{slug}, or your read_skill tool).\n")
    tail = f"{CATALOG_CLOSE}"
    lines = [f"- {s.slug} [{s.category}]: {s.description}\n"
             for s in sorted(skills.values(), key=lambda s: (s.category, s.slug))]
    budget = max_bytes - len(head.encode()) - len(tail.encode())
    kept: list[str] = []
    used = 0
    for i, line in enumerate(lines):
        size = len(line.encode())
        rest = len(lines) - i - 1
        # Room must stay for the "not listed" line whenever a later skill might not fit.
        note = len(f"({len(lines) - i} more skills not listed)\n".encode())
        if used + size + (note if rest else 0) > budget:
            kept.append(f"({len(lines) - i} more skills not listed)\n")
            break
        kept.append(line)
        used += size
    return head + "".join(kept) + tail


def _system_texts(dialect: str, body: Mapping) -> list[str]:
    """The text of the request's system prompt(s), where an injected catalog would be."""
    from reef_core.content import content_text

    if dialect == "anthropic":
        system = body.get("system")
        return [content_text(system, non_text="skip")] if system else []
    out = []
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("role") in ("system", "developer"):
            out.append(content_text(message.get("content"), non_text="skip"))
    return out


def has_catalog(dialect: str, body: Mapping) -> bool:
    """Whether the request's system prompt already holds a catalog (injected before, or pulled by the client)."""
    return any(CATALOG_OPEN in text for text in _system_texts(dialect, body))


def inject_catalog(dialect: str, body: dict, catalog: str) -> dict:
    """``body`` with ``catalog`` in front of its system prompt, unless a catalog is there already."""
    if not catalog or has_catalog(dialect, body):
        return body
    return inject_system(dialect, body, catalog, "extend")


class SkillSurface(HarnessSurface):
    """Serves skill pools per scenario (see the module docstring); a harness surface whose trees are pools.

    Options (``recipe.surface_options``):

    ``inject``                 ``catalog`` (default) or ``none``.
    ``catalog_max_bytes``      cap of the injected catalog (default 8 KiB, at least 512).
    ``max_skills``, ``max_skill_bytes``, ``max_description_chars``: caps of :func:`validate_pool`.
    ``max_total_bytes``, ``max_files``: the harness tree caps.
    """

    serves_skills = True
    #: A pool serves every agent of the scenario as one state: no request is served by another release.
    pins_releases = False

    def __init__(self, artifacts: Any = None, options: Mapping[str, Any] | None = None):
        opts = dict(options or {})
        known = {"inject", "catalog_max_bytes", "max_skills", "max_skill_bytes", "max_description_chars",
                 "max_total_bytes", "max_files"}
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ConfigError(f"skills surface has no option {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        self.inject_catalog = str(opts.pop("inject", None) or "catalog")
        if self.inject_catalog not in ("catalog", "none"):
            raise ConfigError(f"skills surface: inject must be 'catalog' or 'none', not {self.inject_catalog!r}")
        self.pool_limits = {}
        for key, default in (("catalog_max_bytes", DEFAULT_CATALOG_MAX_BYTES), ("max_skills", DEFAULT_MAX_SKILLS),
                             ("max_skill_bytes", DEFAULT_MAX_SKILL_BYTES),
                             ("max_description_chars", DEFAULT_MAX_DESCRIPTION_CHARS)):
            value = opts.pop(key, None)
            value = default if value is None else value
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"skills surface: {key} must be a positive integer, not {value!r}")
            self.pool_limits[key] = value
        self.catalog_max_bytes = self.pool_limits.pop("catalog_max_bytes")
        if self.catalog_max_bytes < MIN_CATALOG_MAX_BYTES:
            raise ConfigError(f"skills surface: catalog_max_bytes must be at least {MIN_CATALOG_MAX_BYTES}")
        super().__init__(artifacts, {**opts, "inject": "none", "max_file_bytes": self.pool_limits["max_skill_bytes"]})
        self._pools: dict[str, tuple[ServedTree, dict[str, Skill], str]] = {}
        self._pool_lock = threading.Lock()

    # -- validation ----------------------------------------------------------------------------------

    def pool(self, files: Mapping[str, Any]) -> dict[str, Skill]:
        """``files`` checked as a skill release; its skills by slug."""
        return validate_pool(files, **self.pool_limits, max_total_bytes=self.limits["max_total_bytes"],
                             max_files=self.limits["max_files"])

    def validate(self, files: Mapping[str, Any]) -> None:
        self.pool(files)

    def checked(self, files: Mapping[str, Any]) -> dict[str, str]:
        self.pool(files)
        return super().checked(files)

    def validate_successor(self, files: Mapping[str, Any], previous: Callable[[], Mapping[str, Any]]) -> None:
        """A trainer's candidate keeps every skill of the serving release (a pool only grows)."""
        before = {path.split("/")[1] for path in previous() if path.startswith(f"{SKILLS_DIR}/")}
        after = {path.split("/")[1] for path in files if path.startswith(f"{SKILLS_DIR}/")}
        missing = sorted(before - after)
        if missing:
            raise ValidationFailed(f"a release may not remove skills; missing: {', '.join(missing)}")

    # -- reading -------------------------------------------------------------------------------------

    def served_pool(self, scenario: str) -> tuple[str | None, dict[str, Skill], str] | None:
        """``(release_id, skills by slug, catalog text)`` serving ``scenario`` now, or None."""
        served = self.current(scenario)
        if served is None:
            return None
        with self._pool_lock:
            cached = self._pools.get(scenario)
            if cached is not None and cached[0] is served:
                return served.release_id, cached[1], cached[2]
        skills = self.pool(served.files)
        catalog = render_catalog(skills, self.catalog_max_bytes)
        with self._pool_lock:
            self._pools[scenario] = (served, skills, catalog)
        return served.release_id, skills, catalog

    # -- request path --------------------------------------------------------------------------------

    def prepare_request(self, scenario: str, dialect: str, body: dict) -> tuple[dict, str | None]:
        found = self.served_pool(scenario)
        if found is None:
            return body, None
        release_id, _skills, catalog = found
        if self.inject_catalog == "catalog":
            body = inject_catalog(dialect, body, catalog)
        return body, release_id
