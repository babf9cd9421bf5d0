"""Which torch device the embedded engine and the trainer run on (``engine.device``, ``trainer.device``).

A device is named ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` and resolved once, at start-up, to
a canonical torch device string (``cpu``, ``cuda:0``, ``mps``): a device the machine lacks is refused
then, naming the config field and what the machine has, rather than failing at the first request.
``auto`` is the first CUDA device when CUDA is available, else the CPU (MPS is only used when named:
its operator coverage is partial). ``trainer.device`` unset follows ``engine.device``, so one knob
places both the served model and the trained one.

torch is imported lazily: resolving ``cpu`` or ``auto`` needs no torch (``auto`` is then the CPU).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import ConfigError

#: The forms a device field accepts, as listed in errors.
DEVICE_FORMS = "auto, cpu, cuda, cuda:N, mps"
_SPEC = re.compile(r"^(auto|cpu|mps|cuda)(?::(\d+))?$")


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _cuda_count(torch) -> int:
    if torch is None or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


def _mps_available(torch) -> bool:
    backend = getattr(getattr(torch, "backends", None), "mps", None)
    return bool(backend is not None and backend.is_available())


def available_devices() -> list[str]:
    """The devices this machine offers, canonically named (always ``cpu`` first)."""
    torch = _torch()
    found = ["cpu"] + [f"cuda:{i}" for i in range(_cuda_count(torch))]
    if torch is not None and _mps_available(torch):
        found.append("mps")
    return found


def resolve_device(spec: Any, *, field: str = "engine.device") -> str:
    """The canonical device ``spec`` names on this machine; :class:`ConfigError` naming ``field`` when
    ``spec`` is malformed or names a device this machine lacks."""
    text = spec.strip().lower() if isinstance(spec, str) else None
    match = _SPEC.match(text) if text else None
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise ConfigError(f"{field} must be one of {DEVICE_FORMS}, not {spec!r}")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":
        return "cpu"
    torch = _torch()
    count = _cuda_count(torch)
    if kind == "auto":
        return "cuda:0" if count else "cpu"
    if kind == "cuda":
        n = int(index) if index is not None else 0
        if n < count:
            return f"cuda:{n}"
        if count == 0:
            why = "torch is not installed" if torch is None else "CUDA is not available on this machine"
        else:
            why = f"this machine has {count} CUDA device{'s' if count > 1 else ''}"
        raise ConfigError(f"{field}={spec} names a device this machine lacks ({why}); "
                          f"available: {', '.join(available_devices())} (or auto)")
    if torch is not None and _mps_available(torch):
        return "mps"
    raise ConfigError(f"{field}={spec} names a device this machine lacks (MPS is not available); "
                      f"available: {', '.join(available_devices())} (or auto)")


def engine_device(engine: Any) -> str:
    """The resolved ``engine.device`` of an engine config section."""
    return resolve_device(engine.device, field="engine.device")


def trainer_device(trainer: Any, engine: Any) -> str:
    """The resolved device of the trainer: ``trainer.device`` when set, else the engine's."""
    if trainer.device is None:
        return engine_device(engine)
    return resolve_device(trainer.device, field="trainer.device")


def check_devices(cfg: Any) -> dict[str, str]:
    """Resolve the devices a deployment uses (at start-up, before anything is built or written).

    ``engine.device`` is checked for the local engine (an upstream engine has no device), ``trainer.device``
    whenever it is set. Returns the resolved ``{"engine": ..., "trainer": ...}`` of those that apply."""
    out: dict[str, str] = {}
    if cfg.engine.kind == "local":
        out["engine"] = engine_device(cfg.engine)
    if cfg.trainer.device is not None or "engine" in out:
        out["trainer"] = trainer_device(cfg.trainer, cfg.engine)
    return out
