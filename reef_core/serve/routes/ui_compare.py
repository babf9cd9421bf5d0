"""The dashboard's comparison page body: two releases' mean reported scores with the bootstrap interval of their
difference, and the mean score of every release in the order the releases served (one plot point a release).

The numbers are ``GET /reef/scenarios/{s}/releases/compare``'s and the per-release means
(:mod:`reef_core.loop.release_compare`); this module only renders them.
"""

from __future__ import annotations

from html import escape
from urllib.parse import quote

from reef_core.client.cli import readable_time
from reef_core.serve.routes.plot import line_svg


def _cell(value, sign: bool = False) -> str:
    return "-" if value is None else f"{value:+.3f}" if sign else f"{value:.3f}"


def default_pair(releases: list[dict]) -> tuple[str | None, str | None]:
    """The pair a page without ``a`` and ``b`` compares: the release served before the last one, and the last."""
    ids = [row["release_id"] for row in releases]
    if not ids:
        return None, None
    return (ids[-2] if len(ids) > 1 else ids[-1]), ids[-1]


def _select(name: str, releases: list[dict], chosen: str | None) -> str:
    options = "".join(
        f'<option value="{escape(r["release_id"])}"{" selected" if r["release_id"] == chosen else ""}>'
        f'{i + 1}: {escape(r["release_id"][:12])}</option>' for i, r in enumerate(releases))
    return f'<label>{name} <select name="{name}">{options}</select></label> '


def comparison_body(scenario: str, scores: dict, comparison: dict | None) -> str:
    releases = scores.get("releases") or []
    link = f"/ui/scenarios/{quote(scenario, safe='')}"
    plot = line_svg("mean score by release", [(i + 1, r["mean"]) for i, r in enumerate(releases)
                                              if r.get("mean") is not None],
                    x_label="release", series="release-mean-score")
    rows = "".join(
        f'<tr class="served"><td>{i + 1}</td><td><a href="{link}/releases/{quote(r["release_id"], safe="")}">'
        f'<code>{escape(r["release_id"][:12])}</code></a></td><td>{escape(readable_time(r.get("first_served_at")))}'
        f'</td><td>{r.get("scored", 0)}</td><td>{_cell(r.get("mean"))}</td></tr>' for i, r in enumerate(releases))
    if comparison is None:
        result = "<p>No release has served a scored record yet.</p>"
        form = ""
    else:
        a, b, diff = comparison["a"], comparison["b"], comparison["difference"]
        interval = ("-" if diff.get("low") is None else
                    f'[<span class="low">{diff["low"]:+.3f}</span>, <span class="high">{diff["high"]:+.3f}</span>]')
        result = ('<table id="comparison"><tr><th></th><th>Release</th><th>Scored</th><th>Mean</th></tr>'
                  + "".join(f'<tr class="side" data-side="{k}"><td>{k}</td><td><code>{escape(s["release_id"][:12])}'
                            f'</code></td><td class="scored">{s["scored"]}</td><td class="mean">{_cell(s["mean"])}'
                            f"</td></tr>" for k, s in (("a", a), ("b", b)))
                  + f'<tr id="difference"><td>b - a</td><td colspan="2">{int(diff["confidence"] * 100)}% interval '
                  f'{interval}</td><td class="mean">{_cell(diff.get("mean"), sign=True)}</td></tr></table>'
                  f'<p>{escape(diff["method"])}; {diff["replicates"]} replicates, seed {diff["seed"]}.</p>')
        form = (f'<form method="get" action="{link}/compare">{_select("a", releases, a["release_id"])}'
                f'{_select("b", releases, b["release_id"])}<button>compare</button></form>')
    unattributed = scores.get("unattributed") or 0
    note = f"<p>{unattributed} scored records were served by no release of the chain.</p>" if unattributed else ""
    return (f'<p><a href="{link}">back to the scenario</a></p>{form}<h2>Comparison</h2>{result}'
            f'<h2>Mean score by release</h2><p>Releases in the order they first served; each point is the mean '
            f'reported score of the records it served.</p><div class="plots">{plot}</div>'
            '<table id="served"><tr><th>#</th><th>Release</th><th>First served</th><th>Scored</th><th>Mean</th></tr>'
            f"{rows}</table>{note}")
