"""``/s/{scenario}/...``: the scenario named in the URL, for a client that cannot send ``x-reef-scenario`` (a stock
app that takes only a base URL, such as ``http://127.0.0.1:8900/s/math/v1``).

Before anything else sees the request, the prefix is taken off the path and the (percent-decoded) scenario becomes
the request's ``x-reef-scenario`` header, so authentication, tenancy, every route and the record see one request.
A header that names another scenario as well is refused like any two disagreeing headers (400).
"""

from __future__ import annotations

from urllib.parse import unquote

from reef_core.wire import SCENARIO_HEADER

PREFIX = "/s/"
_KEY = SCENARIO_HEADER.encode()


def take_scenario_from_path(scope: dict) -> None:
    """Rewrite an HTTP ``scope`` whose path is ``/s/{scenario}/rest`` into ``/rest`` with the scenario header."""
    path = scope.get("path", "")
    if not path.startswith(PREFIX):
        return
    segment, slash, rest = path[len(PREFIX):].partition("/")
    if not segment or not slash:
        return  # not a scenario prefix: left to answer 404
    raw = scope.get("raw_path")
    if raw:  # the segment as sent (its %2F stays one segment): the decoded path cannot tell
        raw_segment, _, raw_rest = raw[len(PREFIX):].partition(b"/")
        name = unquote(raw_segment.decode("latin-1"), encoding="utf-8", errors="surrogateescape")
        scope["raw_path"] = b"/" + raw_rest
    else:
        name = segment
    scope["path"] = "/" + rest
    value = name.encode("utf-8", "surrogateescape")
    headers = list(scope.get("headers") or [])
    if (_KEY, value) not in headers:
        headers.append((_KEY, value))
    scope["headers"] = headers
