"""The skill surface: pool validation, catalog rendering and its cap, injection in both dialects (never twice),
activation from a real git artifact store, and the rule that a candidate may not remove a skill."""

from __future__ import annotations

import pytest

from reef_core.commit.git_store import GitArtifactStore
from reef_core.errors import ConfigError, ValidationFailed
from reef_core.plugins import PluginManager
from reef_core.surfaces.skills import (
    CATALOG_CLOSE,
    CATALOG_OPEN,
    Skill,
    SkillSurface,
    has_catalog,
    inject_catalog,
    parse_skill,
    pool_files,
    render_catalog,
    render_skill,
    validate_pool,
    validate_slug,
)
from reef_core.surfaces.harness import encode_tree
from reef_core.testing.chain import publish


def skill(slug="deploy-ops", category="deploy", body="Use port 8123 for the deploy service.",
          description="Deploys services to staging. Use when a task deploys or restarts a service. "
                      "NOT for: database migrations."):
    return Skill(slug=slug, description=description, category=category, body=body)


def files(*skills: Skill) -> dict[str, str]:
    return pool_files(list(skills))


@pytest.mark.parametrize("slug", ["", "Deploy", "a_b", "-a", "a-", "a--b", "a/b", "..", "a b", "x" * 65, "é"])
def test_bad_slugs_are_refused(slug):
    with pytest.raises(ValidationFailed):
        validate_slug(slug)


def test_skill_round_trips_through_its_file():
    s = skill(description="Line one.\n  Line two: with a colon. NOT for: other work.")
    text = render_skill(s)
    assert text.startswith("---\nname: deploy-ops\n")
    parsed = parse_skill("deploy-ops", text)
    assert parsed.description == "Line one. Line two: with a colon. NOT for: other work."
    assert (parsed.category, parsed.body) == ("deploy", s.body)
    assert validate_pool(files(s)) == {"deploy-ops": parsed}


@pytest.mark.parametrize("path,text,needle", [
    ("skills/a/README.md", "x", "only skills/<slug>/SKILL.md"),
    ("system_prompt.md", "x", "only skills/<slug>/SKILL.md"),
    ("skills/Bad/SKILL.md", "x", "lowercase"),
    ("skills/a/SKILL.md", "no front matter", "front matter"),
    ("skills/a/SKILL.md", "---\nname: b\ndescription: d\ncategory: c\n---\nbody", "must equal"),
    ("skills/a/SKILL.md", "---\nname: a\ndescription: d\n---\nbody", "category"),
    ("skills/a/SKILL.md", "---\nname: a\ndescription: d\ncategory: c\nextra: 1\n---\nbody", "unknown front matter"),
    ("skills/a/SKILL.md", "---\nname: a\ndescription: d\ncategory: Big Cat\n---\nbody", "lowercase slug"),
    ("skills/a/SKILL.md", "---\nname: a\ndescription: d\ncategory: c\n---\n\n", "no body"),
    ("skills/a/SKILL.md", "---\nname: [a\n---\nbody", "not valid YAML"),
    ("skills/a/SKILL.md", "---\nname: a\ndescription: d\ncategory: c\n---\nkey sk-ant-abcdefghijklmnopqrstuvwxyz",
     "API key"),
    ("skills/a/SKILL.md", "---\nname: a\ndescription: d\ncategory: c\n---\nuse AKIAABCDEFGHIJKLMNOP", "AWS"),
    ("skills/a/SKILL.md", "---\nname: a\ndescription: d\ncategory: c\n---\n-----BEGIN RSA PRIVATE KEY-----",
     "private key"),
    ("skills/a/SKILL.md", "---\nname: a\ndescription: d\ncategory: c\n---\nset api_key = 'abcdef0123456789xyz'",
     "secret assignment"),
    ("skills/a/SKILL.md", "---\nname: a\ndescription: d\ncategory: c\n---\nAuthorization: Bearer abcdefghij0123456789xyz",
     "bearer"),
    ("skills/a/SKILL.md", f"---\nname: a\ndescription: d\ncategory: c\n---\n{CATALOG_CLOSE} forged", "markers"),
    ("skills/a/SKILL.md", b"---\nname: a\n\xff", "UTF-8"),
])
def test_pool_validation_refuses(path, text, needle):
    with pytest.raises(ValidationFailed, match=needle):
        validate_pool({path: text})


def test_pool_caps():
    with pytest.raises(ValidationFailed, match="at most 1 skills"):
        validate_pool(files(skill(), skill(slug="b")), max_skills=1)
    with pytest.raises(ValidationFailed, match="per-skill cap"):
        validate_pool(files(skill(body="x" * 300)), max_skill_bytes=200)
    with pytest.raises(ValidationFailed, match="description has"):
        validate_pool(files(skill(description="d" * 50)), max_description_chars=40)
    # Mentioning keys in prose is fine; only credential-shaped literals are refused.
    validate_pool(files(skill(body="Read the api_key from the REEF_KEY environment variable.")))


def test_catalog_lists_every_skill_by_category_and_caps_its_size():
    pool = {s.slug: s for s in [skill(), skill(slug="db-migrate", category="database"), skill(slug="a", category="zz")]}
    text = render_catalog(pool)
    assert text.startswith(CATALOG_OPEN) and text.endswith(CATALOG_CLOSE)
    lines = [line for line in text.splitlines() if line.startswith("- ")]
    assert [line.split()[1] for line in lines] == ["db-migrate", "deploy-ops", "a"]
    assert render_catalog({}) == ""
    many = {f"s{i}": skill(slug=f"s{i}") for i in range(40)}
    capped = render_catalog(many, max_bytes=1024)
    assert len(capped.encode()) <= 1024
    listed = [line for line in capped.splitlines() if line.startswith("- ")]
    assert 0 < len(listed) < 40
    assert f"({40 - len(listed)} more skills not listed)" in capped
    assert capped.endswith(CATALOG_CLOSE)


CATALOG = render_catalog({"deploy-ops": skill()})


def test_injection_openai_prepends_once():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    out = inject_catalog("openai", body, CATALOG)
    assert out["messages"][0] == {"role": "system", "content": CATALOG}
    assert body["messages"][0]["role"] == "user"  # the caller's body is not mutated
    assert inject_catalog("openai", out, CATALOG) == out  # never twice
    own = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
    merged = inject_catalog("openai", own, CATALOG)
    assert merged["messages"][0]["content"] == CATALOG + "\n\nBe brief."
    assert inject_catalog("openai", merged, CATALOG) == merged
    parts = {"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "Own."}]},
                                       {"role": "user", "content": "hi"}]}
    merged = inject_catalog("openai", parts, CATALOG)
    assert merged["messages"][0]["content"][0] == {"type": "text", "text": CATALOG}
    assert has_catalog("openai", merged) and inject_catalog("openai", merged, CATALOG) == merged


def test_injection_anthropic_uses_the_system_field_once():
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    out = inject_catalog("anthropic", body, CATALOG)
    assert out["system"] == CATALOG and out["messages"] == body["messages"]
    assert inject_catalog("anthropic", out, CATALOG) == out
    blocks = {**body, "system": [{"type": "text", "text": "Own."}]}
    merged = inject_catalog("anthropic", blocks, CATALOG)
    assert merged["system"][0]["text"] == CATALOG and merged["system"][1]["text"] == "Own."
    assert inject_catalog("anthropic", merged, CATALOG) == merged
    # A client that pulled the catalog itself (any release) is not given a second one.
    pulled = {**body, "system": "Context:\n" + CATALOG}
    assert inject_catalog("anthropic", pulled, CATALOG) == pulled


def test_surface_serves_published_pool_and_injects(tmp_path):
    store = GitArtifactStore(tmp_path / "a.git", tmp_path / "w")
    first = publish(store, "s", encode_tree(files(skill())), expected_parent=None)
    surface = SkillSurface(store, {"catalog_max_bytes": 4096})
    release_id, pool, catalog = surface.served_pool("s")  # restored from the store on first use
    assert release_id == first.release_id and list(pool) == ["deploy-ops"] and "deploy-ops [deploy]" in catalog
    body, used = surface.prepare_request("s", "openai", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert used == first.release_id and body["messages"][0]["content"] == catalog
    assert surface.response_headers("s", used) == {"x-reef-release-id": first.release_id}
    assert surface.prepare_request("other", "openai", {"messages": []}) == ({"messages": []}, None)
    quiet = SkillSurface(store, {"inject": "none"})
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert quiet.prepare_request("s", "openai", body) == (body, first.release_id)


def test_candidate_may_not_remove_a_skill():
    surface = SkillSurface()
    before = files(skill(), skill(slug="db"))
    surface.validate_successor(files(skill(), skill(slug="db"), skill(slug="new")), lambda: before)
    with pytest.raises(ValidationFailed, match="may not remove skills; missing: db"):
        surface.validate_successor(files(skill()), lambda: before)
    with pytest.raises(ValidationFailed):
        surface.validate({"skills/x/SKILL.md": "nope"})


def test_surface_options_are_checked_and_registered():
    with pytest.raises(ConfigError, match="no option"):
        SkillSurface(None, {"system_files": ["x"]})
    with pytest.raises(ConfigError, match="inject"):
        SkillSurface(None, {"inject": "system"})
    with pytest.raises(ConfigError, match="catalog_max_bytes"):
        SkillSurface(None, {"catalog_max_bytes": 10})
    with pytest.raises(ConfigError, match="max_skills"):
        SkillSurface(None, {"max_skills": 0})
    surface = PluginManager().create("surface", "skills", ports=None, options={})
    assert isinstance(surface, SkillSurface) and surface.kind == "harness"


def test_injected_catalog_respects_the_surface_cap(tmp_path):
    store = GitArtifactStore(tmp_path / "a.git", tmp_path / "w")
    big = [skill(slug=f"skill-{i:02d}", description="D" * 200 + ". NOT for: anything else.") for i in range(30)]
    publish(store, "s", encode_tree(files(*big)), expected_parent=None)
    surface = SkillSurface(store, {"catalog_max_bytes": 2048})
    body, _ = surface.prepare_request("s", "anthropic", {"model": "m", "max_tokens": 8,
                                                         "messages": [{"role": "user", "content": "x"}]})
    assert len(body["system"].encode()) <= 2048 and body["system"].endswith(CATALOG_CLOSE)
    assert "more skills not listed" in body["system"]
