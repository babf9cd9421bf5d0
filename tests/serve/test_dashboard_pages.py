"""The dashboard's door, without a browser: login, cookie scope, refusals and bad inputs (never a 500)."""

from __future__ import annotations

import httpx
import pytest

from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.serve.app import create_app
from reef_core.serve.background import serve_asgi
from reef_core.serve.plot import line_svg

TOKEN, ADMIN = "pages-inference-token", "pages-admin-token"


@pytest.fixture
def url(tmp_path, fake_upstream_url):
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                          f"storage.data_dir={tmp_path}/data", f"server.tokens=[{TOKEN}]",
                          f"server.admin_tokens=[{ADMIN}]"])
    with serve_asgi(create_app(build_deployment(cfg)), lifespan="on") as found:
        answer = httpx.post(f"{found}/v1/chat/completions", headers={"authorization": f"Bearer {TOKEN}",
                                                                     "x-reef-scenario": "pages"},
                            json={"model": "m", "messages": [{"role": "user", "content": "hello"}]})
        assert answer.status_code == 200
        yield found


def test_login_sets_a_scoped_cookie_and_a_wrong_token_is_refused(url):
    with httpx.Client(base_url=url) as browser:
        assert browser.get("/ui").headers["location"] == "/ui/login"
        wrong = browser.post("/ui/login", data={"token": "nope"})
        assert wrong.status_code == 303 and wrong.headers["location"] == "/ui/login?failed=1"
        assert "reef_ui_token" not in browser.cookies
        right = browser.post("/ui/login", data={"token": TOKEN})
        assert right.status_code == 303
        cookie = right.headers["set-cookie"].lower()
        assert "path=/ui" in cookie and "httponly" in cookie and "samesite=strict" in cookie
        page = browser.get("/ui")
        assert page.status_code == 200 and "pages" in page.text
        assert page.headers["content-security-policy"].startswith("default-src 'none'")
        # The cookie opens the dashboard only: the JSON routes still want the header.
        assert browser.get("/reef/scenarios").status_code == 401
        records = browser.get("/ui/scenarios/pages/records")
        assert records.status_code == 200 and records.text.count('class="record"') == 1


@pytest.mark.parametrize("path, status", [
    ("/ui/scenarios/nope", 404), ("/ui/scenarios/pages/records?after=-1", 400),
    ("/ui/scenarios/pages/records?tag=" + "x" * 400, 400), ("/ui/scenarios/pages/records/nope", 404),
    ("/ui/scenarios/pages/releases/abc", 404), ("/ui/login?failed=7", 400),
])
def test_bad_inputs_are_refused_at_the_door(url, path, status):
    assert httpx.get(url + path, headers={"authorization": f"Bearer {TOKEN}"}).status_code == status


def test_rollback_needs_admin_and_confirmation(url):
    inference = httpx.post(f"{url}/ui/scenarios/pages/rollback", cookies={"reef_ui_token": TOKEN},
                           data={"release_id": "x", "confirm": "yes"})
    assert inference.status_code == 403
    unconfirmed = httpx.post(f"{url}/ui/scenarios/pages/rollback", cookies={"reef_ui_token": ADMIN},
                             data={"release_id": "x"})
    assert unconfirmed.status_code == 400 and "confirm" in unconfirmed.text
    junk = httpx.post(f"{url}/ui/scenarios/pages/rollback", cookies={"reef_ui_token": ADMIN},
                      content=b"\xff\xfe" * 10, headers={"content-type": "application/x-www-form-urlencoded"})
    assert junk.status_code == 400


def test_plot_has_one_marker_per_finite_point():
    svg = line_svg("reward", [(1, 0.5), (2, float("nan")), (3, 0.7), (4, 0.7)])
    assert svg.count('class="pt"') == 3 and 'data-points="3"' in svg
    assert "no data yet" in line_svg("loss", [])
    assert "&lt;script" in line_svg("<script>", [(1, 1.0)])


def test_docs_lists_every_route_offline(url):
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{url}/docs").status_code == 401
    page = httpx.get(f"{url}/docs", headers=auth)
    assert page.status_code == 200 and "cdn" not in page.text.lower() and "<script" not in page.text
    spec = httpx.get(f"{url}/openapi.json", headers=auth).json()
    for path, item in spec["paths"].items():
        for method in item:
            assert f"<code>{method.upper()} {path}</code>" in page.text, (method, path)
    assert "<code>POST /ui/scenarios/{scenario}/rollback</code> (admin token)" in page.text
