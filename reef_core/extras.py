"""Optional parts of reef-core and the pip extra that installs each.

``pip install reef-core`` serves through an upstream engine with SQLite and harness recipes; the
heavy dependencies come with extras. A deployment whose config needs a missing one fails at start-up
with a ConfigError (``reef serve`` exits 2) naming the extra, instead of an ImportError deep inside.
"""

from __future__ import annotations

import importlib.util

from reef_core.errors import ConfigError

# extra -> the modules it provides (checked without importing them: torch alone takes seconds)
EXTRAS: dict[str, tuple[str, ...]] = {
    "local": ("torch", "transformers", "tokenizers", "safetensors"),
    "train": ("torch", "transformers", "safetensors", "peft"),
    "postgres": ("psycopg",),
    "ray": ("ray",),
    "demo": ("gguf",),
    "client": ("httpx",),
    # reef export --format hf|parquet: a Hugging Face datasets directory or a Parquet file
    "export": ("datasets", "pyarrow"),
    # observability.tracing: the OpenTelemetry SDK and its OTLP exporters (http/protobuf and grpc)
    "otel": ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http", "opentelemetry.exporter.otlp.proto.grpc"),
}


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses the name
        return False


def missing(extra: str) -> list[str]:
    return [name for name in EXTRAS[extra] if not _installed(name)]


def require_modules(requires: dict[str, str], what: str) -> None:
    """Raise ConfigError ``"<what> needs <requirement>"`` when a module a plugin component declared
    (``register(..., requires={module: requirement})``) is not installed."""
    absent = {module: req for module, req in requires.items() if not _installed(module)}
    if absent:
        reqs = sorted(set(absent.values()))
        raise ConfigError(f"{what} needs {', '.join(reqs)}: pip install {' '.join(repr(r) for r in reqs)} "
                          f"(not installed: {', '.join(sorted(absent))})")


def require(extra: str, what: str) -> None:
    """Raise ConfigError ``"<what> needs reef-core[<extra>]"`` when a module of ``extra`` is not installed."""
    absent = missing(extra)
    if absent:
        raise ConfigError(f"{what} needs reef-core[{extra}]: pip install 'reef-core[{extra}]' "
                          f"(not installed: {', '.join(absent)})")
