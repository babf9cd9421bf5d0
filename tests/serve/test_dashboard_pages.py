"""The dashboard's door, without a browser: login, cookie scope, refusals and bad inputs (never a 500)."""

from __future__ import annotations

import re

import httpx
import pytest

from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.serve.app import create_app
from reef_core.background import serve_asgi
from reef_core.serve.routes.plot import line_svg

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


def form_token(page: str) -> str:
    """The per-session form token a dashboard page's forms carry (hidden field ``csrf``)."""
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


def test_rollback_needs_admin_and_confirmation(url):
    inference = httpx.post(f"{url}/ui/scenarios/pages/rollback", cookies={"reef_ui_token": TOKEN},
                           data={"release_id": "x", "confirm": "yes"})
    assert inference.status_code == 403
    csrf = form_token(httpx.get(f"{url}/ui/scenarios/pages/rollback?release_id=x",
                                cookies={"reef_ui_token": ADMIN}).text)
    unconfirmed = httpx.post(f"{url}/ui/scenarios/pages/rollback", cookies={"reef_ui_token": ADMIN},
                             data={"release_id": "x", "csrf": csrf})
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


def test_cross_site_dashboard_posts_are_refused_and_store_nothing(url):
    """D4 (#37): a page on another port of the same host gets the SameSite=Strict cookie sent with its form posts;
    Origin / Sec-Fetch-Site refuse them, and a per-session form token refuses a post that carries neither."""
    other = url.rsplit(":", 1)[0] + ":1"  # another local port: same site, another origin
    releases = f"{url}/reef/scenarios/pages/releases"
    admin_auth = {"authorization": f"Bearer {ADMIN}"}
    before = httpx.get(releases, headers=admin_auth).json()["releases"]
    release_id = before[0]["release_id"] if before else "f" * 40

    # login: refused cross-site (no cookie set), accepted from the dashboard's own origin
    for headers in ({"origin": other}, {"sec-fetch-site": "same-site"}, {"sec-fetch-site": "cross-site"},
                    {"origin": "null"}):
        refused = httpx.post(f"{url}/ui/login", data={"token": ADMIN}, headers=headers)
        assert refused.status_code == 403 and "cross-site" in refused.text, (headers, refused.text)
        assert "set-cookie" not in refused.headers
    with httpx.Client(base_url=url) as browser:
        signed_in = browser.post("/ui/login", data={"token": ADMIN}, headers={"origin": url,
                                                                              "sec-fetch-site": "same-origin"})
        assert signed_in.status_code == 303 and browser.cookies.get("reef_ui_token")
        csrf = form_token(browser.get(f"/ui/scenarios/pages/rollback?release_id={release_id}").text)
        form = {"release_id": release_id, "confirm": "yes", "csrf": csrf}
        # the signed-in admin's browser, posting from another port: refused, even with a right token
        for headers in ({"origin": other}, {"sec-fetch-site": "same-site"}, {"origin": "null"}):
            refused = browser.post("/ui/scenarios/pages/rollback", data=form, headers=headers)
            assert refused.status_code == 403 and "cross-site" in refused.text, (headers, refused.text)
        # no Origin header at all (an old browser) and no form token, or a wrong one: refused, naming the token
        for bad in ({k: v for k, v in form.items() if k != "csrf"}, {**form, "csrf": "0" * len(csrf)}):
            refused = browser.post("/ui/scenarios/pages/rollback", data=bad)
            assert refused.status_code == 403 and "form token" in refused.text, refused.text
        assert httpx.get(releases, headers=admin_auth).json()["releases"] == before  # nothing stored
        # logout: same checks; a refused one leaves the session signed in
        assert browser.post("/ui/logout", headers={"origin": other}).status_code == 403
        assert browser.post("/ui/logout").status_code == 403
        assert browser.get("/ui").status_code == 200
        logout_token = form_token(browser.get("/ui").text)
        assert browser.post("/ui/logout", data={"csrf": logout_token}, headers={"origin": url}).status_code == 303
        # the same-origin post with the token works
        assert browser.post("/ui/login", data={"token": ADMIN}).status_code == 303
        csrf = form_token(browser.get(f"/ui/scenarios/pages/rollback?release_id={release_id}").text)
        done = browser.post("/ui/scenarios/pages/rollback", data={**form, "csrf": csrf}, headers={"origin": url})
        assert done.status_code in (303, 404, 409), done.text  # past the door: the release's own answer
        assert "cross-site" not in done.text and "form token" not in done.text
