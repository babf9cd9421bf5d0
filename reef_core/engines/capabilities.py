"""What an engine can take besides requests: full weights (:class:`WeightSink`), LoRA adapters (:class:`AdapterSink`).

Structural (``typing.Protocol``, checked at run time with ``isinstance``): an engine has a capability by having its
methods, whatever it derives from. :class:`~reef_core.engines.local.LocalEngine` and
:class:`~reef_core.engines.remote.RemoteEngine` (SGLang, vLLM) have both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from reef_core.models.adapter import AdapterWeights


@runtime_checkable
class WeightSink(Protocol):
    """An engine that serves new full weights: ``swap_weights(version, state_dict)`` loads the (possibly partial)
    state dict and serves it as ``version`` from the next request on (``None``: only renames the served version)."""

    async def swap_weights(self, version: str, state_dict: dict | None = None) -> None: ...


@runtime_checkable
class AdapterSink(Protocol):
    """An engine that serves named LoRA adapters beside its base: ``load_adapter(name, version, adapter)`` adds or
    replaces ``name``'s adapter (``None``: the base) served as ``version``; ``drop_adapter(name)`` forgets it."""

    async def load_adapter(self, name: str, version: str, adapter: AdapterWeights | None) -> None: ...

    async def drop_adapter(self, name: str) -> None: ...
