"""One SkillClaw night: the day's graded sessions in, the next pool out.

:meth:`Evolver.night` runs the steps of the reference recipe on a scratch copy of the pool:

1. one :class:`~reef_skillclaw.digest.SessionDigest` per session, from the recorded traffic;
2. a summary per session (``summarize``; a failed call leaves the session without one);
3. the judge grades only the unscored sessions (the sentinel); its ``overall`` is the weighted sum of its four
   scores; it is shown to the evolver as a judged grade and never enters the reported-score mean;
4. groups: one per skill a session read (a session that read two skills is in both), plus the no-skill bucket;
   each group keeps its newest ``max_sessions_per_group`` sessions;
5. one decision per group, one JSON object: ``improve_skill``, ``optimize_description``, ``create_skill`` or
   ``skip`` (the no-skill bucket: ``create_skill`` or ``skip``). Output that is not exactly one JSON object, or
   names an action the group may not take, skips the group and is counted; a transport error is retried
   ``retries`` times with backoff, then skips the group;
6. a created skill whose name is already in the pool (or was created earlier the same night) is merged into it
   by the model (merge prompt), or, when the merge answer is unusable, by keeping both bodies' distinct lines;
   a skill that would not validate (e.g. a credential-shaped literal) is not applied and is counted;
7. the night never removes a skill: the result holds every skill it started with.

The result's ``pool`` differs from the input only by the applied decisions; the trainer publishes that diff as
one release.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from reef_core.api import (
    ChatModel,
    Sample,
    Skill,
    UpstreamError,
    ValidationFailed,
    pool_files,
    render_skill,
    validate_pool,
    validate_slug,
)

from . import prompts
from .digest import SessionDigest, build_digest
from .options import SkillClawOptions

log = logging.getLogger("reef_skillclaw")

NO_SKILL = None  #: the key of the no-skill bucket
SKILL_ACTIONS = ("improve_skill", "optimize_description", "create_skill", "skip")
BUCKET_ACTIONS = ("create_skill", "skip")


@dataclass
class NightResult:
    pool: dict[str, Skill]
    #: one row per applied change: {slug, action, group}
    changes: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    digests: list[SessionDigest] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.changes)


def parse_json_object(text: str) -> dict | None:
    """The one JSON object ``text`` holds (a ```json fence around it is allowed), else None."""
    if not isinstance(text, str):
        return None
    body = text.strip()
    if body.startswith("```"):
        first_newline = body.find("\n")
        if first_newline < 0 or not body.endswith("```"):
            return None
        body = body[first_newline + 1:-3].strip()
    if not body.startswith("{"):
        return None
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    if body[end:].strip() or not isinstance(value, dict):
        return None
    return value


def _text_field(decision: dict, key: str) -> str | None:
    value = decision.get(key)
    return value.strip() if isinstance(value, str) and value.strip() else None


class Evolver:
    """The night's logic, with its models injected (see the module docstring)."""

    def __init__(self, options: SkillClawOptions, *, decide: ChatModel, summary: ChatModel | None = None,
                 judge: ChatModel | None = None, sleep: Callable[[float], None] = time.sleep,
                 pool_limits: Mapping[str, int] | None = None):
        self.options = options
        self.decide_model = decide
        self.summary_model = summary or decide
        self.judge_model = judge or decide
        self.sleep = sleep
        self.pool_limits = dict(pool_limits or {})

    # -- model calls -------------------------------------------------------------------------------------------

    def _call(self, model: ChatModel, system: str, user: str) -> str | None:
        """The model's answer, retrying transport errors; None once every attempt failed."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        delay = self.options.retry_backoff_s
        for attempt in range(self.options.retries):
            try:
                return model(messages)
            except (UpstreamError, OSError, TimeoutError) as exc:
                log.warning("skillclaw model call failed (attempt %d of %d): %s", attempt + 1, self.options.retries,
                            exc)
                if attempt + 1 < self.options.retries:
                    self.sleep(delay)
                    delay *= 2
        return None

    # -- the night -------------------------------------------------------------------------------------------

    def night(self, samples: list[Sample], pool: Mapping[str, Skill]) -> NightResult:
        opts = self.options
        counts = {"sessions": len(samples), "summaries_failed": 0, "judged": 0, "judge_failed": 0, "groups": 0,
                  "unparsable": 0, "invalid_action": 0, "model_failed": 0, "rejected_skills": 0, "merged": 0,
                  "merge_fallbacks": 0}
        actions = {a: 0 for a in SKILL_ACTIONS}
        digests = [build_digest(s, skill_tools=opts.skill_tools, max_text_chars=opts.max_text_chars)
                   for s in samples]
        if opts.summarize:
            for d in digests:
                d.summary = self._call(self.summary_model, prompts.SUMMARY_SYSTEM,
                                       prompts.summary_user(d.render(opts.max_digest_chars)))
                counts["summaries_failed"] += d.summary is None
        for d in digests:
            if d.score is None:
                d.judged = self._judge(d)
                counts["judged" if d.judged is not None else "judge_failed"] += 1
        scratch = dict(pool)
        created_tonight: set[str] = set()
        changes: list[dict] = []
        groups = self.groups(digests, pool)
        counts["groups"] = len(groups)
        for key, members in groups:
            texts = [d.render(opts.max_digest_chars) for d in members]
            if key is NO_SKILL:
                catalog = [f"- {s.slug} [{s.category}]: {s.description}" for s in scratch.values()]
                answer = self._call(self.decide_model, prompts.CREATE_SYSTEM, prompts.create_user(catalog, texts))
                allowed = BUCKET_ACTIONS
            else:
                answer = self._call(self.decide_model, prompts.DECIDE_SYSTEM,
                                    prompts.decide_user(render_skill(scratch[key]), texts))
                allowed = SKILL_ACTIONS
            group_name = key or "(no skill)"
            if answer is None:
                counts["model_failed"] += 1
                continue
            decision = parse_json_object(answer)
            if decision is None:
                counts["unparsable"] += 1
                log.info("skillclaw: unparsable decision for group %s; skipped", group_name)
                continue
            action = decision.get("action")
            if action not in allowed:
                counts["invalid_action"] += 1
                log.info("skillclaw: action %r is not allowed for group %s; skipped", action, group_name)
                continue
            applied = self._apply(key, action, decision, scratch, created_tonight, counts)
            if applied is None:
                continue
            actions[action] += 1
            if action != "skip":
                changes.append({"slug": applied, "action": action, "group": key})
        # The night only adds and rewrites: every skill of the pool it started from is still there.
        if not set(pool) <= set(scratch):
            raise RuntimeError("a night removed a skill")  # unreachable: decisions only add and rewrite
        scored = [d.score for d in digests if d.score is not None]
        metrics = {**counts, "actions": actions,
                   "scored_sessions": len(scored), "unscored_sessions": len(digests) - len(scored),
                   # the day's mean over reported scores only: the unscored sentinel is never averaged
                   "mean_reported_score": round(sum(scored) / len(scored), 6) if scored else None,
                   "pool_before": len(pool), "pool_after": len(scratch), "changes": len(changes)}
        return NightResult(pool=scratch, changes=changes, metrics=metrics, digests=digests)

    def groups(self, digests: list[SessionDigest], pool: Mapping[str, Skill]) -> list[tuple[str | None, list]]:
        """``[(slug or NO_SKILL, sessions)]``: skills in slug order, then the no-skill bucket."""
        by_skill: dict[str, list[SessionDigest]] = {}
        bucket: list[SessionDigest] = []
        for d in digests:
            read = [slug for slug in d.skills_read if slug in pool]
            for slug in read:
                by_skill.setdefault(slug, []).append(d)
            if not read:
                bucket.append(d)
        cap = self.options.max_sessions_per_group
        out: list[tuple[str | None, list]] = [(slug, by_skill[slug][-cap:]) for slug in sorted(by_skill)]
        if bucket:
            out.append((NO_SKILL, bucket[-cap:]))
        return out

    def _judge(self, digest: SessionDigest) -> float | None:
        answer = self._call(self.judge_model, prompts.JUDGE_SYSTEM,
                            prompts.judge_user(digest.render(self.options.max_digest_chars)))
        verdict = parse_json_object(answer) if answer is not None else None
        if verdict is None:
            return None
        weights = self.options.judge_weights
        total = 0.0
        for key, weight in weights.items():
            value = verdict.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                return None
            total += weight * float(value)
        return round(total / (sum(weights.values()) or 1.0), 6)

    # -- applying decisions -----------------------------------------------------------------------------------

    def _valid(self, skill: Skill) -> Skill | None:
        """``skill`` as the pool would hold it, or None when it does not validate."""
        try:
            return validate_pool(pool_files([skill]), **self.pool_limits)[skill.slug]
        except ValidationFailed as exc:
            log.info("skillclaw: skill %s refused: %s", skill.slug, exc.message)
            return None

    def _apply(self, key: str | None, action: str, decision: dict, scratch: dict[str, Skill],
               created_tonight: set[str], counts: dict) -> str | None:
        """Apply one decision to ``scratch``; the slug it changed ('' for skip), or None when refused."""
        if action == "skip":
            return ""
        if action == "improve_skill":
            content = _text_field(decision, "content")
            if content is None:
                counts["invalid_action"] += 1
                return None
            candidate = replace(scratch[key], body=content)
        elif action == "optimize_description":
            description = _text_field(decision, "description")
            if description is None:
                counts["invalid_action"] += 1
                return None
            candidate = replace(scratch[key], description=description)
        else:  # create_skill
            fields = {k: _text_field(decision, k) for k in ("name", "description", "category", "content")}
            if any(v is None for v in fields.values()):
                counts["invalid_action"] += 1
                return None
            try:
                slug = validate_slug(fields["name"])
            except ValidationFailed:
                counts["rejected_skills"] += 1
                return None
            candidate = Skill(slug=slug, description=fields["description"], category=fields["category"],
                              body=fields["content"])
            if slug in scratch:
                candidate = self._merge(scratch[slug], candidate, counts)
            else:
                created_tonight.add(slug)
        checked = self._valid(candidate)
        if checked is None:
            counts["rejected_skills"] += 1
            return None
        scratch[checked.slug] = checked
        return checked.slug

    def _merge(self, existing: Skill, incoming: Skill, counts: dict) -> Skill:
        """One skill from two of the same name (model merge; distinct lines of both when its answer is unusable)."""
        counts["merged"] += 1
        answer = self._call(self.decide_model, prompts.MERGE_SYSTEM,
                            prompts.merge_user(render_skill(existing), render_skill(incoming)))
        merged = parse_json_object(answer) if answer is not None else None
        description = _text_field(merged, "description") if merged else None
        content = _text_field(merged, "content") if merged else None
        if description and content:
            return replace(existing, description=description, body=content)
        counts["merge_fallbacks"] += 1
        lines = existing.body.splitlines()
        seen = {line.strip() for line in lines if line.strip()}
        extra = []
        for line in incoming.body.splitlines():
            if line.strip() and line.strip() not in seen:
                seen.add(line.strip())
                extra.append(line)
        body = "\n".join(lines + ([""] if extra else []) + extra)
        return replace(existing, body=body)
