"""The dashboard's "By release" section: the newest ``reef eval releases`` run of a scenario.

One plot a task set (score by release: x is the release's position in the chain, 0 the oldest, one point per
evaluated release), the scores per release, and the forgetting of each set
(:func:`reef_core.loop.eval_results.forgetting`). The run is a file under the data directory, so every value is
read defensively: a field that is not what it should be is shown as "-", never an error page.
"""

from __future__ import annotations

import math
from html import escape
from urllib.parse import quote

from reef_core.client.cli import readable_time
from reef_core.serve.routes.plot import line_svg


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value) else None


def _cell(value) -> str:
    number = _number(value)
    return "-" if number is None else f"{number:.3g}"


def _rows(run: dict) -> list[dict]:
    return [row for row in run.get("releases") or [] if isinstance(row, dict) and isinstance(row.get("index"), int)
            and isinstance(row.get("release_id"), str) and isinstance(row.get("scores"), dict)]


def by_release_section(scenario: str, run: dict | None) -> str:
    """The section's HTML; an invitation to run the command when the scenario has no run yet."""
    if run is None:
        return ("<h2>By release</h2><p>No release evaluation yet: <code>reef eval releases --scenario "
                f"{escape(scenario)} --tasks FILE</code> scores every retained release on held-out tasks.</p>")
    rows = _rows(run)
    sets = [name for name in (run.get("sets") or {}) if isinstance(name, str)]
    plots = "".join(
        line_svg(f"score by release: {name}", [(row["index"], v) for row in rows
                                               if (v := _number(row["scores"].get(name))) is not None],
                 x_label="release", series=f"release-score-{name}")
        for name in sets)
    link = f"/ui/scenarios/{quote(scenario, safe='')}/releases/"
    table = "".join(
        f'<tr class="evaluated"><td>{row["index"]}</td><td><a href="{link}{quote(row["release_id"], safe="")}">'
        f'<code>{escape(row["release_id"][:12])}</code></a></td><td>{escape(str(row.get("operation", "")))}</td>'
        + "".join(f"<td>{_cell(row['scores'].get(name))}</td>" for name in sets)
        + f"<td>{escape(str(row.get('error') or ''))}</td></tr>" for row in rows)
    forgetting = (run.get("forgetting") or {}).get("sets") or {}
    lost = "".join(
        f'<tr class="forgetting"><td>{escape(name)}</td>'
        + "".join(f"<td>{_cell((forgetting.get(name) or {}).get(k))}</td>" for k in ("first", "best", "last",
                                                                                    "forgetting"))
        + "</tr>" for name in sets)
    verifier = (run.get("verifier") or {}).get("name", "?")
    return (f"<h2>By release</h2><p>{len(rows)} releases scored by <code>reef eval releases</code> on "
            f"{escape(readable_time(run.get('created_at')))} UTC: task sets {escape(', '.join(sets))}, verifier "
            f"<code>{escape(str(verifier))}</code>; {len(run.get('skipped') or [])} skipped.</p>"
            f'<div class="plots">{plots}</div>'
            '<table id="release-scores"><tr><th>#</th><th>Release</th><th>Operation</th>'
            + "".join(f"<th>{escape(name)}</th>" for name in sets) + "<th>Error</th></tr>" + table + "</table>"
            '<h3>Forgetting</h3><p>Best score of an earlier release minus the last release\'s (positive: lost).</p>'
            '<table id="forgetting"><tr><th>Set</th><th>First</th><th>Best earlier</th><th>Last</th>'
            "<th>Forgetting</th></tr>" + lost + "</table>")
