"""A model directory's digest (reef_core/models/digest.py) is the hash of its files, hashed once per content: a later
call with the files unchanged reads it back, any change to a file (its size, its bytes with the modification time set
back, a new file) hashes again, and a cache it cannot read or write only means hashing."""

from __future__ import annotations

import json
import os

import pytest

from reef_core.models import digest


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "model"
    (path / "sub").mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(3 << 20))
    (path / "config.json").write_text("{}")
    (path / "sub" / "x.bin").write_bytes(b"x")
    return path


def _counting(monkeypatch) -> list:
    calls = []
    real = digest.hash_files
    monkeypatch.setattr(digest, "hash_files", lambda d: calls.append(d) or real(d))
    return calls


def test_the_digest_is_hashed_once_per_content(model_dir, monkeypatch):
    calls = _counting(monkeypatch)
    first = digest.model_digest(model_dir)
    assert first == digest.hash_files(model_dir) and first.startswith("sha256:")
    assert digest.model_digest(model_dir) == first
    assert len(calls) == 2  # the first call and the check above; the second call read the cache
    assert json.loads(digest.cache_path(model_dir).read_text())["digest"] == first


def test_any_change_to_the_files_hashes_again(model_dir, monkeypatch):
    first = digest.model_digest(model_dir)
    weights = model_dir / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and modification time, other bytes
    changed = digest.model_digest(model_dir)
    assert changed != first and changed == digest.hash_files(model_dir)
    (model_dir / "extra.txt").write_text("new")
    assert digest.model_digest(model_dir) == digest.hash_files(model_dir) != changed


def test_a_broken_or_unwritable_cache_only_means_hashing(model_dir, monkeypatch):
    path = digest.cache_path(model_dir)
    path.parent.mkdir(parents=True)
    path.write_text("not json")
    expected = digest.hash_files(model_dir)
    assert digest.model_digest(model_dir) == expected
    blocker = model_dir.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(digest, "cache_path", lambda d: blocker / "digest.json")  # its directory cannot be made
    assert digest.model_digest(model_dir) == expected
