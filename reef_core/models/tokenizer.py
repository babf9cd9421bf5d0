"""A model directory's tokenizer through the ``tokenizers`` library alone, for the local engine's start-up.

Why: ``reef serve``'s start-up spent ~0.8 s importing transformers' package for a ``PreTrainedTokenizerFast``
(issue #41), whose work on the engine's path is ``tokenizer.json``'s encode and decode and one Jinja render of the
chat template. :func:`load` builds :class:`LeanTokenizer` from the same files and gives what transformers gives
(the tests compare token ids, rendered templates and decoded text with transformers'):

* ``apply_chat_template(messages, add_generation_prompt=..., tokenize=False, tools=...)``: rendered as transformers
  renders it: a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``, loop controls, the
  ``{% generation %}`` tag, transformers' ``tojson`` filter and its ``raise_exception``, ``strftime_now``, ``dict``
  and ``namespace`` globals; messages with their None-valued keys dropped, reasoning copied under the names
  templates read, everything the template sees rebuilt from plain data, the named special tokens passed as
  variables;
* ``tok(text, add_special_tokens=False)["input_ids"]``, ``decode(ids, skip_special_tokens=...)``, ``get_vocab()``,
  ``eos_token_id``, ``chat_template``.

Only what it reproduces exactly is taken: a ``tokenizer_class`` transformers loads from ``tokenizer.json`` as written
(``PreTrainedTokenizerFast``, ``TokenizersBackend``), one chat template, every named special token and every entry
of ``added_tokens_decoder`` already in ``tokenizer.json`` with the same flags, no ``split_special_tokens``, no
``add_prefix_space``, no clean-up of decoded spaces outside BPE (transformers skips it for BPE), a vocabulary
under transformers' 100k-entry Mistral regex check. Anything else returns None and the caller loads through
transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
#: Classes transformers builds from tokenizer.json without rewriting it.
FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
#: transformers' named special tokens (``special_tokens_map``), in its order: the template variables it passes.
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_ADDED_FLAGS = ("special", "lstrip", "rstrip", "normalized", "single_word")
_MISTRAL_CHECK_VOCAB = 100_000  # above this transformers may patch the pre-tokenizer's regex


class LeanTokenizer:
    """The engine's view of a fast tokenizer (see the module docstring): encode, decode, render the chat template."""

    def __init__(self, backend, template: str | None, special: dict[str, str]):
        self._backend = backend
        self.chat_template = template
        self.special_tokens_map = special
        self._compiled = _compile(template) if template is not None else None
        eos = special.get("eos_token")
        self.eos_token_id = backend.token_to_id(eos) if eos is not None else None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        if add_special_tokens:  # the post-processor's template is not reproduced; the engine never asks for it
            raise NotImplementedError("LeanTokenizer encodes with add_special_tokens=False only")
        return {"input_ids": self._backend.encode(text, add_special_tokens=False).ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs) -> str:
        """The rendered prompt (``tokenize=False`` only: the engine tokenizes the text itself)."""
        if tokenize:
            raise NotImplementedError("LeanTokenizer renders with tokenize=False only")
        if self._compiled is None:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be JSON schemas (dicts)")
        messages = []
        for message in conversation:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
            messages.append({k: v for k, v in message.items() if v is not None})
        variables = _plain({**self.special_tokens_map, **kwargs})
        return self._compiled.render(messages=_alias_reasoning(_plain(messages)), tools=_plain(tools),
                                     documents=None, add_generation_prompt=add_generation_prompt, **variables)


def load(model_dir: Path) -> LeanTokenizer | None:
    """``model_dir``'s tokenizer without transformers, or None when it is not one this module reproduces exactly."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not (model_dir / TOKENIZER_FILE).is_file() or not _config_ok(config, model_dir):
        return None
    template = _template(config, model_dir)
    if template is False:
        return None
    from tokenizers import Tokenizer

    try:  # read by the library itself: parsing its JSON in Python too cost ~0.2 s
        backend = Tokenizer.from_file(str(model_dir / TOKENIZER_FILE))
    except Exception:  # noqa: BLE001 - a file this version cannot read: transformers says what is wrong with it
        return None
    if backend.get_vocab_size(with_added_tokens=True) > _MISTRAL_CHECK_VOCAB:
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None  # transformers keeps them, which changes encode
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None
    added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    special = {name: token for name in SPECIAL_NAMES if (token := _content(config.get(name))) is not None}
    if any(token not in added or not added[token].special for token in special.values()):
        return None  # transformers would add it as a new special token
    for entry in (config.get("added_tokens_decoder") or {}).values():
        have = added.get(entry.get("content")) if isinstance(entry, dict) else None
        if have is None or any(getattr(have, k) != entry.get(k) for k in _ADDED_FLAGS):
            return None  # transformers would add it, or change its flags
    return LeanTokenizer(backend, template, special)


def _config_ok(config: dict, model_dir: Path) -> bool:
    """Whether transformers would take ``config`` without rewriting the tokenizer (see the module docstring)."""
    if config.get("tokenizer_class") not in FAST_CLASSES:
        return False
    if config.get("split_special_tokens") or config.get("add_prefix_space") or config.get("extra_special_tokens"):
        return False
    return not (config.get("additional_special_tokens") or (model_dir / "special_tokens_map.json").exists())


def _content(token) -> str | None:
    if isinstance(token, dict):  # a serialized AddedToken
        token = token.get("content")
    return token if isinstance(token, str) else None


def _template(config: dict, model_dir: Path) -> str | None | bool:
    """The one chat template (the ``.jinja`` file wins over the config, as in transformers), None when there is none,
    False when there are several (named templates: not reproduced)."""
    if (model_dir / TEMPLATE_DIR).exists() or isinstance(config.get("chat_template"), (list, dict)):
        return False
    path = model_dir / TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


# --------------------------------------------------------------------------- the chat template's environment


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON-like types; anything else becomes ``<TypeName>`` (as transformers does)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    """A message's reasoning under every name templates read (``thinking`` first, ``reasoning_content`` last)."""
    out = []
    for message in messages:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def _compile(template: str):
    """``template`` compiled in transformers' chat-template environment."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body (transformers also tracks where it lies,
        for assistant masks the engine never asks for)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace refusing underscore-prefixed attributes (CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    class Dict:
        """``dict(...)`` and ``dict.fromkeys(...)`` only: no attribute access to the dict type."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not Jinja's own filter: that one escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    return env.from_string(template)
