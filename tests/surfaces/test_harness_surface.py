"""The harness surface: path and content validation, system-prompt injection (OpenAI and Anthropic),
activation and restore from a real git artifact store."""

from __future__ import annotations

import copy

import pytest

from reef_core.commit.git_store import GitArtifactStore
from reef_core.errors import ConfigError, ValidationFailed
from reef_core.plugins import PluginManager
from reef_core.surfaces.harness import (
    RELEASE_HEADER,
    HarnessSurface,
    inject_system,
    render_system_prompt,
    validate_harness_path,
    validate_tree,
)
from reef_core.testing.chain import publish

PROMPT = "You are the current harness."


@pytest.mark.parametrize("path", [
    "", "/etc/passwd", "../secret", "a/../b", "a/..", "./a", "a/./b", "a//b", "a/", "a\\b", "..\\x",
    "C:x", "C:\\windows", "a\x00b", "a\nb", "a\x7fb", "%2e%2e/x", "..%2fx", "a%00", ".git/config", "x/.GIT/hooks",
    "reef-artifact.json", ".gitattributes", "x" * 600,
    # Leading or trailing whitespace: the install script reads paths with `read`, which trims it (#37 D7).
    " lead.md", "trail.md ", "dir/x.md ", "\u3000wide.md", "x.md\u00a0",
])
def test_bad_paths_are_refused(path):
    with pytest.raises(ValidationFailed):
        validate_harness_path(path)


@pytest.mark.parametrize("path", ["system_prompt.md", "skills/search/SKILL.md", "dir.v2/notes..md", "règles.md",
                                  ".hidden/rules.md", "a/b/c/d.txt"])
def test_good_paths_pass(path):
    assert validate_harness_path(path) == path


def test_a_tree_with_a_path_install_cannot_write_is_refused():
    with pytest.raises(ValidationFailed, match="whitespace"):
        validate_tree({"system_prompt.md": "x", "rules.md ": "y"})
    assert validate_harness_path("with space/in the middle.md") == "with space/in the middle.md"


def test_tree_is_text_only_and_capped():
    assert validate_tree({"b.md": b"two", "a.md": "one"}) == {"a.md": "one", "b.md": "two"}
    for bad, needle in [({"x.bin": b"\xff\xfe\x00"}, "UTF-8"), ({"x.md": "a\x00b"}, "NUL"), ({"x.md": 3}, "text"),
                        ({"a": "x", "a/b": "y"}, "share a path"), ({"../x": "y"}, "'..'")]:
        with pytest.raises(ValidationFailed, match=needle):
            validate_tree(bad)
    with pytest.raises(ValidationFailed, match="per-file cap"):
        validate_tree({"big.md": "é" * 6}, max_file_bytes=10)  # 12 bytes in UTF-8
    with pytest.raises(ValidationFailed, match="total cap"):
        validate_tree({"a.md": "x" * 6, "b.md": "y" * 6}, max_total_bytes=10)
    with pytest.raises(ValidationFailed, match="at most 2 files"):
        validate_tree({"a": "", "b": "", "c": ""}, max_files=2)


def test_render_system_prompt_joins_listed_files_in_order():
    tree = {"rules.md": "Rules.", "system_prompt.md": "System.", "skill.md": "Skill."}
    assert render_system_prompt(tree, ["system_prompt.md", "rules.md", "missing.md"]) == "System.\n\nRules."
    assert render_system_prompt(tree) == "System."
    assert render_system_prompt({}, ["system_prompt.md"]) == ""


def test_openai_injection_sets_extends_and_never_duplicates():
    user = {"role": "user", "content": "hi"}
    body = {"model": "m", "messages": [user]}
    before = copy.deepcopy(body)
    out = inject_system("openai", body, PROMPT)
    assert out["messages"] == [{"role": "system", "content": PROMPT}, user]
    assert body == before  # the client's body is never mutated

    own = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, user]}
    out = inject_system("openai", own, PROMPT)
    assert out["messages"][0] == {"role": "system", "content": PROMPT + "\n\nBe brief."}
    assert own["messages"][0]["content"] == "Be brief."
    assert inject_system("openai", out, PROMPT)["messages"] == out["messages"]  # already there: unchanged

    parts = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Dev."}]}, user]}
    out = inject_system("openai", parts, PROMPT)
    assert out["messages"][0] == {"role": "developer", "content": [{"type": "text", "text": PROMPT},
                                                                  {"type": "text", "text": "Dev."}]}
    out = inject_system("openai", own, PROMPT, "replace")
    assert out["messages"][0] == {"role": "system", "content": PROMPT}


def test_anthropic_injection_sets_extends_and_never_duplicates():
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert inject_system("anthropic", body, PROMPT)["system"] == PROMPT
    assert "system" not in body
    assert inject_system("anthropic", {**body, "system": "Be brief."}, PROMPT)["system"] == PROMPT + "\n\nBe brief."
    blocks = {**body, "system": [{"type": "text", "text": "Cached.", "cache_control": {"type": "ephemeral"}}]}
    out = inject_system("anthropic", blocks, PROMPT)
    assert out["system"] == [{"type": "text", "text": PROMPT},
                             {"type": "text", "text": "Cached.", "cache_control": {"type": "ephemeral"}}]
    assert inject_system("anthropic", out, PROMPT)["system"] == out["system"]
    assert inject_system("anthropic", {**body, "system": "x"}, PROMPT, "replace")["system"] == PROMPT


def _surface(**options) -> HarnessSurface:
    return HarnessSurface(None, {"inject": "system", **options})


def test_surface_injects_current_release_for_both_dialects():
    surface = _surface()
    assert surface.prepare_request("s", "openai", {"messages": []}) == ({"messages": []}, None)
    assert surface.response_headers("s", None) == {}
    surface.activate("s", "r1", payload={"system_prompt.md": PROMPT, "notes.md": "not injected"})
    body, release = surface.prepare_request("s", "openai", {"messages": [{"role": "user", "content": "q"}]})
    assert release == "r1" and body["messages"][0] == {"role": "system", "content": PROMPT}
    body, release = surface.prepare_request("s", "anthropic", {"max_tokens": 9, "messages": [
        {"role": "user", "content": "q"}]})
    assert release == "r1" and body["system"] == PROMPT
    assert surface.response_headers("s", release) == {RELEASE_HEADER: "r1"}
    assert surface.serving_version("s") == "r1"
    assert surface.serving_version("other") is None
    surface.activate("s", "r2", payload={"system_prompt.md": "Second."})
    assert surface.prepare_request("s", "openai", {"messages": []})[0]["messages"][0]["content"] == "Second."


def test_surface_without_injection_only_tags_the_release():
    surface = HarnessSurface(None, {})
    surface.activate("s", "r1", payload={"system_prompt.md": PROMPT})
    body = {"messages": [{"role": "user", "content": "q"}]}
    assert surface.prepare_request("s", "openai", body) == (body, "r1")


def test_surface_system_files_and_refused_activation_keeps_serving():
    surface = _surface(system_files=["rules.md", "system_prompt.md"])
    surface.activate("s", "r1", payload={"system_prompt.md": "Sys.", "rules.md": "Rules."})
    assert surface.system_text("s") == "Rules.\n\nSys."
    with pytest.raises(ValidationFailed):
        surface.activate("s", "r2", payload={"../escape.md": "x"})
    with pytest.raises(ValidationFailed):
        surface.activate("s", "r3", files=lambda: {"bin.dat": b"\xff\x00"})
    assert surface.serving_version("s") == "r1" and surface.system_text("s") == "Rules.\n\nSys."
    surface.activate("s", None)
    assert surface.current("s") is None


def test_surface_options_are_checked():
    with pytest.raises(ConfigError, match="no option"):
        HarnessSurface(None, {"injct": "system"})
    with pytest.raises(ConfigError, match="inject"):
        HarnessSurface(None, {"inject": "always"})
    with pytest.raises(ConfigError, match="system_files"):
        HarnessSurface(None, {"system_files": ["../x"]})


def test_surface_restores_head_from_artifact_store(tmp_path):
    store = GitArtifactStore(tmp_path / "artifacts.git", tmp_path / "work")
    first = publish(store, "s", {"system_prompt.md": b"First."}, expected_parent=None)
    second = publish(store, "s", {"system_prompt.md": "Second é.".encode()}, expected_parent=first.release_id)
    surface = HarnessSurface(store, {"inject": "system"})  # the one port the surface reads
    assert surface.serving_version("s") == second.release_id  # loaded on first use
    assert surface.system_text("s") == "Second é."
    assert surface.serving_version("never-published") is None
    surface.activate("s", first.release_id)  # by id: read back from the store
    assert surface.system_text("s") == "First."
    surface.activate("s", second.release_id, files=lambda: store.read_files(second.release_id))
    assert surface.current("s").files == {"system_prompt.md": "Second é."}


def test_harness_surface_is_a_registered_component():
    pm = PluginManager(load_entry_points=False)
    surface = pm.create("surface", "harness", ports=None, options={"inject": "system"})
    assert isinstance(surface, HarnessSurface) and surface.kind == "harness"
