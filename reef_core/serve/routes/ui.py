"""The dashboard at ``/ui``: server-rendered HTML pages over the same data as the JSON routes.

Read-only for an inference token; an admin token also sees rollback buttons and, on releases held for review
(``evaluation.publish=review``), promote buttons; each asks for confirmation on a page of its own before it posts. The token comes from the login form and lives in a cookie scoped to ``/ui``
(HttpOnly, SameSite=Strict); :class:`~reef_core.serve.middleware.auth.AuthMiddleware` reads it there for ``/ui`` paths
only, and sends a browser without a valid one to the login page.

Cross-site posts (D4, #37): SameSite=Strict still sends the cookie from a page on another port of the same host, so
every dashboard POST is refused (403, nothing stored) when ``Sec-Fetch-Site`` says ``same-site``/``cross-site`` or
``Origin`` is not this server's own; and every form of a signed-in page carries a per-session token (hidden field
``csrf``: an HMAC keyed by the cookie's token over the session's random ``reef_ui_session`` cookie, set at login),
which a cookie-authenticated POST (logout, rollback, promote) must send back. Login has no session yet: the
Origin/Sec-Fetch-Site check guards it. A request that presents its token in a header is not a browser's ambient
credential and needs no form token. Plots are SVG drawn here
(:mod:`reef_core.serve.routes.plot`): no script and no CDN.

Pages: ``/ui`` (scenarios with recipe, current release and learner state), ``/ui/scenarios/{s}`` (plots over
steps of reward, loss, gate score, publish latency and policy lag; score by release from the newest ``reef eval
releases`` run, with forgetting; the release chain and every gate decision with its reason),
``/ui/scenarios/{s}/records`` (paged, filtered by type and tag), one record with its payload,
``/ui/scenarios/{s}/compare`` (two releases' mean reported scores and their difference, the mean by release).
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import hmac
import json
import math
import secrets
from html import escape
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from reef_core.errors import Conflict, Forbidden, NotFound, ValidationFailed
from reef_core.client.cli import readable_time
from reef_core.serve.middleware.auth import ADMIN, UI_COOKIE, _cookie_token, _presented_token
from reef_core.serve.routes.names import path_record, path_scenario
from reef_core.serve.routes.plot import line_svg
from reef_core.serve.routes.reads import MAX_SEQUENCE, record_row
from reef_core.serve.routes.ui_compare import comparison_body, default_pair
from reef_core.serve.routes.ui_evaluations import by_release_section
from reef_core.serve.middleware.tenancy import principal_of, visible

#: The session's random nonce, set at login beside the token cookie; the form token is keyed over it.
UI_SESSION_COOKIE = "reef_ui_session"
#: ``Sec-Fetch-Site`` values of a post the dashboard's own pages (or the user, typing) made.
_OWN_SITES = frozenset({"same-origin", "none"})


def _same_origin(request: Request) -> None:
    """Refuse a cross-site dashboard POST (403 naming why) before its body is read: nothing is stored."""
    if request.method != "POST":
        return
    for site in request.headers.getlist("sec-fetch-site"):
        if site.strip().lower() not in _OWN_SITES:
            raise Forbidden(f"cross-site dashboard post refused (Sec-Fetch-Site: {site[:40]}): "
                            "post from the dashboard's own pages")
    host = request.headers.get("host", "").lower()
    for origin in request.headers.getlist("origin"):
        parts = urlsplit(origin.strip()) if origin.strip() != "null" else None
        if parts is None or not parts.scheme or parts.netloc.lower() != host:
            raise Forbidden(f"cross-site dashboard post refused (Origin {origin[:200]!r} is not this server's "
                            f"{host[:200]!r}): post from the dashboard's own pages")


def form_token(request: Request) -> str:
    """The session's form token: HMAC-SHA256 keyed by the dashboard cookie's token over its session nonce."""
    token = _cookie_token(request.scope["headers"]) or ""
    session = request.cookies.get(UI_SESSION_COOKIE, "")
    return hmac.new(token.encode("utf-8", "surrogatepass"), b"reef-ui-form\0" + session.encode("utf-8", "replace"),
                    hashlib.sha256).hexdigest()


def _token_field(request: Request) -> str:
    return f'<input type="hidden" name="csrf" value="{form_token(request)}">'


router = APIRouter(dependencies=[Depends(_same_origin)])
PAGE = 50
_HEADERS = {"cache-control": "no-store", "x-frame-options": "DENY",
            "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                                       "form-action 'self'"}

_STYLE = """body{font:14px system-ui,sans-serif;margin:1.5em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:4px 6px;text-align:left;
vertical-align:top}th{background:#f4f4f4}.selected{color:#176f2c}.rejected{color:#a31515}code{font-size:12px}
.plots{display:flex;flex-wrap:wrap;gap:12px}.plot{margin:0}svg{background:#fafafa;border:1px solid #ddd}
svg .line{fill:none;stroke:#2563eb;stroke-width:1.5}svg .pt{fill:#2563eb}svg .axis{stroke:#999}
svg text{font-size:10px;fill:#555}pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:40em}
nav a{margin-right:1em}"""


def _page(title: str, body: str, status: int = 200, headers: dict | None = None) -> HTMLResponse:
    html = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,"><title>{escape(title)} · Reef</title>'
            f'<style>{_STYLE}</style></head><body><nav><a href="/ui">Scenarios</a></nav>'
            f"<h1>{escape(title)}</h1>{body}</body></html>")
    return HTMLResponse(html, status_code=status, headers={**_HEADERS, **(headers or {})})


def _q(value: str) -> str:
    return quote(value, safe="")


def _scope(request: Request) -> str:
    return request.scope.get("state", {}).get("reef_scope", "inference")


async def _form(request: Request, *, session: bool = True) -> dict[str, str]:
    """A urlencoded form body, size-limited; its last value per field. A cookie-authenticated post of a session
    (``session``: all but login) must carry the session's form token (``csrf``), else 403."""
    limit = request.app.state.reef.server.max_admin_body_bytes
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ValidationFailed(f"form body over {limit} bytes")
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False, max_num_fields=20)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValidationFailed(f"not a urlencoded form: {exc}") from None
    form = {k: v[-1] for k, v in fields.items()}
    if session and _presented_token(request.scope["headers"]) is None:
        if not hmac.compare_digest(form.get("csrf", "").encode("utf-8", "replace"), form_token(request).encode()):
            raise Forbidden("the dashboard's form token (csrf) is missing or wrong: post from the dashboard's own "
                            "pages, signed in")
    return form


# -- login -------------------------------------------------------------------------------------------------


@router.get("/ui/login", response_class=HTMLResponse)
async def login_form(request: Request, failed: int = Query(0, ge=0, le=1)):
    note = '<p class="rejected">That token is not valid.</p>' if failed else ""
    return _page("Sign in", f'{note}<form method="post" action="/ui/login"><label>Token '
                 '<input type="password" name="token" autocomplete="off" required></label> '
                 '<button type="submit">Sign in</button></form>'
                 "<p>An inference token reads; an admin token may also roll back.</p>")


@router.post("/ui/login", response_class=HTMLResponse)
async def login(request: Request):
    token = (await _form(request, session=False)).get("token", "")
    tokens = request.app.state.reef_tokens
    if tokens.enabled and (not token or tokens.scope_of(token) is None):
        return RedirectResponse("/ui/login?failed=1", status_code=303, headers=_HEADERS)
    response = RedirectResponse("/ui", status_code=303, headers=_HEADERS)
    # Scoped to the dashboard's pages; never readable by a script, never sent cross-site.
    response.set_cookie(UI_COOKIE, quote(token, safe=""), path="/ui", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    # A new session nonce each login: the forms' token changes with it.
    response.set_cookie(UI_SESSION_COOKIE, secrets.token_urlsafe(32), path="/ui", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    return response


@router.post("/ui/logout", response_class=HTMLResponse)
async def logout(request: Request):
    await _form(request)  # the session's form token, else 403 and still signed in
    response = RedirectResponse("/ui/login", status_code=303, headers=_HEADERS)
    response.delete_cookie(UI_COOKIE, path="/ui")
    response.delete_cookie(UI_SESSION_COOKIE, path="/ui")
    return response


# -- scenarios -----------------------------------------------------------------------------------------------


@router.get("/ui", response_class=HTMLResponse)
async def scenarios(request: Request):
    dep = request.app.state.reef
    status = await asyncio.to_thread(dep.status)
    rows = []
    for s in visible(request.scope, await asyncio.to_thread(dep.list_scenarios)):
        if s.archived:
            continue
        found = status.get("scenarios", {}).get(s.name) or {}
        rows.append(f'<tr><td><a href="/ui/scenarios/{_q(s.name)}">{escape(s.name)}</a></td>'
                    f"<td>{escape(str(s.recipe))}</td><td><code>{escape(str(found.get('current_release_id') or '-'))[:12]}"
                    f"</code></td><td>{escape(str(found.get('learner') or '-'))}</td>"
                    f"<td>{escape(str(found.get('step') or 0))}</td></tr>")
    table = ("<table><tr><th>Scenario</th><th>Recipe</th><th>Current release</th><th>Learner</th><th>Step</th></tr>"
             + "".join(rows) + "</table>") if rows else "<p>No scenario yet: send a request with x-reef-scenario.</p>"
    return _page("Scenarios", table + '<form method="post" action="/ui/logout">'
                 f'{_token_field(request)}<button>Sign out</button></form>')


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value) else None


def _series(commits: list[dict], releases: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Per-step series from the commit log (training metrics, gate scores) and the chain (publish latency)."""
    out: dict[str, list[tuple[float, float]]] = {"reward": [], "loss": [], "gate score": [], "policy lag": [],
                                                  "publish latency": []}
    for row in commits:
        step, metrics = row.get("step"), row.get("metrics") or {}
        if row.get("operation") != "training" and not row.get("decision"):
            continue
        reward = next((_number(metrics.get(k)) for k in ("reward_mean", "reward", "mean_score")
                       if _number(metrics.get(k)) is not None), None)
        if reward is None:
            reward = next((_number(v) for k, v in metrics.items() if k.endswith("reward_mean")
                           and _number(v) is not None), None)
        for name, value in (("reward", reward), ("loss", _number(metrics.get("loss"))),
                            ("policy lag", _number(metrics.get("policy_lag_mean")))):
            if value is not None:
                out[name].append((step, value))
        scores = [_number(s) for s in ((row.get("evaluation") or {}).get("scores") or [])]
        scores = [s for s in scores if s is not None]
        if scores:
            out["gate score"].append((step, sum(scores) / len(scores)))
    for release in releases:
        metrics = release.get("metrics") or {}
        step, latency = _number(metrics.get("step")), _number(metrics.get("publish_latency_ms"))
        if step is not None and latency is not None:
            out["publish latency"].append((step, latency))
    return {k: sorted(v) for k, v in out.items()}


def _reward_of_reports(records: list) -> list[tuple[float, float]]:
    """Scores of the reports in arrival order: the reward a recipe without training metrics still shows."""
    return [(float(i + 1), r.payload["score"]) for i, r in enumerate(records)
            if r.kind == "report" and _number(r.payload.get("score")) is not None]


async def _all_commits(dep, scenario) -> list[dict]:
    rows, after = [], 0
    while True:
        page = await asyncio.to_thread(dep.commit_rows, scenario, after, 100, None)
        rows += page
        if len(page) < 100 or len(rows) >= 5000:  # the plots show the last 5000 steps at most
            return rows
        after = page[-1]["step"]


@router.get("/ui/scenarios/{scenario}", response_class=HTMLResponse)
async def scenario_page(request: Request, scenario: str):
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario)
    commits = await _all_commits(dep, found)
    releases = await asyncio.to_thread(dep.release_rows, found.name)
    status = await asyncio.to_thread(dep.scenario_status, found)
    evaluations = await asyncio.to_thread(dep.evaluation_runs, found.name, 1)
    series = _series(commits, releases)
    units = {"publish latency": "ms"}
    plots = "".join(line_svg(name, points, unit=units.get(name, "")) for name, points in series.items())
    admin = _scope(request) == "admin"
    chain = []
    for r in releases:
        source = r.get("source") or {}
        reason = source.get("reason") or source.get("kind") or ""
        action = ""
        if admin and r.get("pending"):
            action = f'<a href="/ui/scenarios/{_q(found.name)}/promote?release_id={_q(r["release_id"])}">promote</a>'
        elif admin and not r.get("current") and r.get("restorable"):
            action = (f'<a href="/ui/scenarios/{_q(found.name)}/rollback?release_id={_q(r["release_id"])}">roll back '
                      "to this</a>")
        link = f'/ui/scenarios/{_q(found.name)}/releases/{_q(r["release_id"])}'
        chain.append(f'<tr class="release selected"><td><a href="{link}"><code>{escape(r["release_id"][:12])}'
                     "</code></a></td>"
                     f"<td>{escape(str(r.get('operation')))}</td><td>{escape(str((r.get('metrics') or {}).get('step', '')))}"
                     f"</td><td>{'current' if r.get('current') else 'pending review' if r.get('pending') else ''}</td>"
                     f"<td>{escape(str(reason))}</td><td>{escape(readable_time(r.get('created_at')))}</td><td>{action}</td></tr>")
    decisions = []
    for row in reversed(commits):
        decision = row.get("decision") or {}
        if not decision:
            continue
        kind = "selected" if decision.get("decision") == "select" else "rejected"
        decisions.append(f'<tr class="decision {kind}"><td>{row.get("step")}</td><td>{kind}</td>'
                         f"<td>{escape(str(decision.get('policy', '')))}</td>"
                         f"<td>{escape(str(decision.get('reason', '')))}</td>"
                         f"<td><code>{escape(str(row.get('release_id') or '-')[:12])}</code></td></tr>")
    body = (f"<p>Recipe <b>{escape(str(status.get('recipe', found.recipe)))}</b> · learner "
            f"<b>{escape(str(status.get('learner', '-')))}</b> · step {escape(str(status.get('step', 0)))} · current "
            f"release <code>{escape(str(status.get('current_release_id') or '-'))}</code> · "
            f'<a href="/ui/scenarios/{_q(found.name)}/records">records</a> · '
            f'<a href="/ui/scenarios/{_q(found.name)}/compare">compare releases</a></p>'
            + _trouble(status) +
            f'<h2>Over steps</h2><div class="plots">{plots}</div>'
            + by_release_section(found.name, evaluations[0] if evaluations else None) +
            "<h2>Release chain</h2><table id=\"chain\"><tr><th>Release</th><th>Operation</th><th>Step</th><th>State</th>"
            "<th>Source</th><th>Created</th><th></th></tr>" + "".join(chain) + "</table>"
            "<h2>Gate decisions</h2><table id=\"decisions\"><tr><th>Step</th><th>Decision</th><th>Policy</th>"
            "<th>Reason</th><th>Release</th></tr>" + "".join(decisions) + "</table>")
    return _page(f"Scenario {found.name}", body)


def _trouble(status: dict) -> str:
    """What went wrong, where a person sees it: failed or skipped steps (with the last error) and the samples
    dropped without training, by reason; nothing when all is well."""
    counters = status.get("counters") or {}
    parts = []
    if counters.get("errors") or status.get("last_error"):
        parts.append(f'<p class="errors">{escape(str(counters.get("errors", 0)))} failed or skipped steps; last error: '
                     f'<code>{escape(str(status.get("last_error") or "-"))}</code></p>')
    dropped = status.get("dropped") or {}
    if dropped:
        cells = "".join(f"<tr><td>{escape(str(reason))}</td><td>{escape(str(count))}</td></tr>"
                        for reason, count in sorted(dropped.items()))
        parts.append('<h2>Dropped samples</h2><table id="dropped"><tr><th>Reason</th><th>Samples</th></tr>'
                     f"{cells}</table>")
    if status.get("quarantined"):
        parts.append(f'<p class="errors">quarantined: <code>{escape(str(status["quarantined"]))}</code></p>')
    return "".join(parts)


@router.get("/ui/scenarios/{scenario}/compare", response_class=HTMLResponse)
async def compare_page(request: Request, scenario: str, a: str = Query("", max_length=200),
                       b: str = Query("", max_length=200)):
    """Two releases' mean reported scores and the interval of their difference (default: the last two releases
    that served), and the mean score of every release in the order they served."""
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario)
    scores = await asyncio.to_thread(dep.release_scores, found)
    first, last = default_pair(scores["releases"])
    a, b = a or first, b or last
    comparison = await asyncio.to_thread(dep.compare_releases, found, a, b) if a and b else None
    return _page(f"Compare releases of {found.name}", comparison_body(found.name, scores, comparison))


# -- release files -------------------------------------------------------------------------------------------

#: Files shown inline (and diffed) up to this size; larger or binary ones (weights) are listed with their size.
TEXT_LIMIT = 64 * 1024


def _text(data: bytes) -> str | None:
    if len(data) > TEXT_LIMIT:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@router.get("/ui/scenarios/{scenario}/releases/{release_id}", response_class=HTMLResponse)
async def release_page(request: Request, scenario: str, release_id: str):
    """The file tree of one release of the scenario (a harness or skill tree), with a diff against its parent."""
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario)
    rows = await asyncio.to_thread(dep.release_rows, found.name)
    row = next((r for r in rows if r.get("release_id") == release_id), None)
    if row is None:
        raise NotFound(f"scenario {found.name!r} has no release {release_id[:80]!r}")
    try:
        files = await asyncio.to_thread(dep.release_files, release_id)
        parent_id = row.get("parent_release_id")
        parent = await asyncio.to_thread(dep.release_files, parent_id) if parent_id else {}
    except Conflict as exc:  # weights garbage-collected: the release is listed, its files are gone
        return _page(f"Release {release_id[:12]}", f"<p>{escape(exc.message)}</p>")
    listing, diffs = [], []
    for path in sorted(set(files) | set(parent)):
        now, before = files.get(path), parent.get(path)
        state = "added" if before is None else "removed" if now is None else "changed" if now != before else ""
        size = len(now) if now is not None else 0
        listing.append(f'<tr class="file"><td><code>{escape(path)}</code></td><td>{size}</td><td>{state}</td></tr>')
        if state:
            old_text = _text(before) if before is not None else ""
            new_text = _text(now) if now is not None else ""
            if old_text is None or new_text is None:
                diffs.append(f"<p><code>{escape(path)}</code>: binary or large ({state})</p>")
            else:
                diff = "".join(difflib.unified_diff(old_text.splitlines(keepends=True),
                                                    new_text.splitlines(keepends=True),
                                                    f"a/{path}", f"b/{path}"))
                diffs.append(f'<pre class="diff">{escape(diff)}</pre>')
    shown = "".join(f"<h3><code>{escape(p)}</code></h3><pre>{escape(t)}</pre>"
                    for p, t in ((p, _text(d)) for p, d in sorted(files.items())) if t is not None)
    parent_link = (f'<a href="/ui/scenarios/{_q(found.name)}/releases/{_q(row["parent_release_id"])}">'
                   f'{escape(row["parent_release_id"][:12])}</a>') if row.get("parent_release_id") else "none"
    body = (f"<p>{escape(str(row.get('operation')))} · parent {parent_link} · "
            f'<a href="/ui/scenarios/{_q(found.name)}">back to the scenario</a></p>'
            '<h2>Files</h2><table id="files"><tr><th>Path</th><th>Bytes</th><th>vs parent</th></tr>'
            + "".join(listing) + "</table><h2>Diff against the parent</h2>"
            + ("".join(diffs) or "<p>no change</p>") + "<h2>Contents</h2>" + shown)
    return _page(f"Release {release_id[:12]} of {found.name}", body)


# -- records -------------------------------------------------------------------------------------------------


def _tag_filter(tag: str) -> tuple[str, str | None] | None:
    if not tag:
        return None
    if len(tag) > 300:
        raise ValidationFailed("tag: at most 300 characters", param="tag")
    name, sep, value = tag.partition("=")
    return name, (value if sep else None)


@router.get("/ui/scenarios/{scenario}/records", response_class=HTMLResponse)
async def records_page(request: Request, scenario: str, after: int = Query(0, ge=0, le=MAX_SEQUENCE),
                       type: str = Query("", max_length=40), tag: str = Query("", max_length=300)):
    """A page of records (oldest first), filtered by type (``inference``, ``report``...) and by tag
    (``name`` or ``name=value``); the filters scan at most 20 store pages per screen."""
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario, archived=True)
    wanted = _tag_filter(tag)
    shown, cursor, more = [], after, False
    for _ in range(20):
        rows = await asyncio.to_thread(dep.records_page, found.name, cursor, 100)
        for r in rows:
            cursor = r.sequence
            if type and r.kind != type:
                continue
            if wanted and (wanted[0] not in r.tags or (wanted[1] is not None and r.tags[wanted[0]] != wanted[1])):
                continue
            shown.append(r)
            if len(shown) == PAGE:
                break
        if len(shown) == PAGE or len(rows) < 100:
            more = len(shown) == PAGE or len(rows) == 100
            break
    else:
        more = True
    base = f"/ui/scenarios/{_q(found.name)}/records"
    lines = []
    for r in shown:
        row = record_row(r)
        tags = ", ".join(f"{k}={v}" for k, v in row["tags"].items())
        lines.append(f'<tr class="record"><td>{row["sequence"]}</td><td><a href="{base}/{_q(r.record_id)}">'
                     f'{escape(r.record_id)}</a></td><td>{escape(r.kind)}</td><td>{escape(str(row["score"] if row["score"] is not None else ""))}'
                     f"</td><td>{escape(tags)}</td><td><code>{escape(str(row['artifact_ref'] or '')[:12])}</code></td>"
                     f"<td>{'' if row['complete'] else 'incomplete'}</td></tr>")
    filters = {k: v for k, v in (("type", type), ("tag", tag)) if v}
    nav = (f'<a id="next" href="{base}?{urlencode({"after": cursor, **filters})}">next page</a>' if more else
           '<span id="end">end of records</span>')
    form = (f'<form method="get" action="{base}"><label>type <input name="type" value="{escape(type)}"></label> '
            f'<label>tag <input name="tag" value="{escape(tag)}" placeholder="name or name=value"></label> '
            '<button>filter</button></form>')
    body = (form + '<table id="records"><tr><th>#</th><th>Record</th><th>Type</th><th>Score</th><th>Tags</th>'
            "<th>Version</th><th></th></tr>" + "".join(lines) + f"</table><p>{nav}</p>")
    return _page(f"Records of {found.name}", body)


@router.get("/ui/scenarios/{scenario}/records/{record_id}", response_class=HTMLResponse)
async def record_page(request: Request, scenario: str, record_id: str):
    record = await path_record(request.app.state.reef, scenario, record_id)
    row = record_row(record)
    payload = json.dumps(record.payload, indent=2, ensure_ascii=False, default=str)
    refs = "".join(f'<li><a href="/ui/scenarios/{_q(scenario)}/records/{_q(ref)}">{escape(ref)}</a></li>'
                   for ref in row["references"])
    body = (f"<p>{escape(record.kind)} · version <code>{escape(str(record.version or '-'))}</code> · "
            f"{'complete' if record.complete else 'incomplete'} · {escape(readable_time(row['created_at']))} UTC</p>"
            + (f"<h2>References</h2><ul>{refs}</ul>" if refs else "")
            + f"<h2>Payload</h2><pre>{escape(payload)}</pre>")
    return _page(f"Record {record.record_id}", body)


# -- admin ---------------------------------------------------------------------------------------------------


#: The release operations the dashboard offers an admin: the question its confirmation page asks, and its button.
_OPERATIONS = {
    "rollback": ("Serve release {release} of {scenario} again, as a new release?", "Roll back"),
    "promote": ("Serve release {release} of {scenario}, held for review, as the new release?", "Promote"),
}


async def _confirm(request: Request, scenario: str, release_id: str, operation: str) -> HTMLResponse:
    found = await path_scenario(request.app.state.reef, scenario)
    question, button = _OPERATIONS[operation]
    text = escape(question).format(release=f"<code>{escape(release_id)}</code>", scenario=f"<b>{escape(found.name)}</b>")
    body = (f'<p>{text}</p><form method="post" action="/ui/scenarios/{_q(found.name)}/{operation}">'
            f'<input type="hidden" name="release_id" value="{escape(release_id)}">'
            f'<input type="hidden" name="confirm" value="yes">{_token_field(request)}<button type="submit" id="confirm">{button}</button> '
            f'<a href="/ui/scenarios/{_q(found.name)}">cancel</a></form>')
    return _page(f"Confirm {operation}", body)


async def _republish(request: Request, scenario: str, operation: str) -> Response:
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario)
    form = await _form(request)
    release_id = form.get("release_id", "")
    if form.get("confirm") != "yes" or not release_id:
        raise ValidationFailed(f"a {operation} needs release_id and confirm=yes (from the confirmation page)")
    by = principal_of(request.scope).name  # who moved the head, in the new release's source
    await asyncio.to_thread(dep.republish, found, operation, release_id, {"by": by})
    return RedirectResponse(f"/ui/scenarios/{_q(found.name)}", status_code=303, headers=_HEADERS)


_RELEASE_ID = Query(..., min_length=1, max_length=200)


@router.get("/ui/scenarios/{scenario}/rollback", response_class=HTMLResponse, openapi_extra=ADMIN)
async def rollback_confirm(request: Request, scenario: str, release_id: str = _RELEASE_ID):
    return await _confirm(request, scenario, release_id, "rollback")


@router.post("/ui/scenarios/{scenario}/rollback", response_class=HTMLResponse, openapi_extra=ADMIN)
async def rollback(request: Request, scenario: str):
    return await _republish(request, scenario, "rollback")


@router.get("/ui/scenarios/{scenario}/promote", response_class=HTMLResponse, openapi_extra=ADMIN)
async def promote_confirm(request: Request, scenario: str, release_id: str = _RELEASE_ID):
    return await _confirm(request, scenario, release_id, "promote")


@router.post("/ui/scenarios/{scenario}/promote", response_class=HTMLResponse, openapi_extra=ADMIN)
async def promote(request: Request, scenario: str):
    return await _republish(request, scenario, "promote")


def no_token_redirect() -> Response:
    """Where a browser without a valid dashboard cookie goes."""
    return RedirectResponse("/ui/login", status_code=303, headers=_HEADERS)
