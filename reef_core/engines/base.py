"""The engine interface: what the server calls to run one inference.

An :class:`Engine` serves one or more wire dialects natively (``dialects``). The server hands it an
:class:`EngineRequest` whose body is already in one of those dialects (see
:mod:`reef_core.engines.translate` or :class:`reef_core.engines.bridge.DialectBridge` for the others).

Error contract, shared by every engine:

* provider 4xx in :data:`RELAYED_STATUSES` -> an :class:`EngineResponse` with that status, the provider's
  body and its ``retry-after`` header (relayed to the client as is);
* any other provider 4xx -> an :class:`EngineResponse` with status 400 and the provider's body;
* provider 5xx, connection failures, malformed provider output -> :class:`reef_core.errors.UpstreamError`
  (502); timeouts -> :class:`reef_core.errors.UpstreamTimeout` (504);
* a request the engine cannot serve (wrong dialect, untranslatable field) ->
  :class:`reef_core.errors.ValidationFailed` (400).

Streams. ``Engine.stream`` is an async generator of :class:`StreamEvent`. When the provider answers a
streaming request with something that is not a stream (a relayed 4xx, or a plain JSON body), the
generator raises :class:`DirectResponse` *before yielding anything*; the server sends
``exc.response`` as an ordinary response. Token data of a stream (local engine) arrives as one extra
event ``StreamEvent(event=TOKENS_EVENT, data=TokenData.to_event())`` placed immediately before the
terminal event (``[DONE]``, or ``message_stop`` after translation). A stream may also start with
``StreamEvent(event=HEADERS_EVENT, data={provider response headers})`` (upstream engines). The server must
consume every ``reef.*`` event and never relay it; translators pass them through untouched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

from reef_core.topk import TopK
from reef_core.errors import ReefError

Dialect = Literal["openai", "anthropic"]

#: Provider statuses relayed to the client unchanged (upstream-reef §1.8).
RELAYED_STATUSES = frozenset({400, 401, 403, 404, 408, 409, 413, 422, 429})

#: Name of the event carrying a stream's :class:`TokenData` (never sent to clients).
TOKENS_EVENT = "reef.tokens"

#: Optional first event of a stream: the provider's response headers worth copying (never sent as an event).
HEADERS_EVENT = "reef.headers"


#: The route a dialect uses for generation.
GENERATE_ROUTE: dict[str, str] = {"openai": "chat", "anthropic": "messages"}


@dataclass
class EngineRequest:
    """One inference request, as the server hands it to an engine."""

    dialect: Dialect  # dialect of `body`
    route: str  # "chat" | "messages" | "count_tokens"
    body: dict  # the client's JSON body, possibly translated
    headers: dict[str, str] = field(default_factory=dict)  # already filtered: no auth, no x-reef-*
    # Artifact version (release id) the server froze for this request; the local engine serves it with the LoRA
    # adapter that version belongs to (the base for any other), see reef_core.engines.local.
    version: str | None = None
    # Whether the answer must carry its TokenData (a scenario whose weights train). The embedded engine always
    # captures; an HTTP serving engine (engine.kind=sglang, vllm) sends the others through the server's own OpenAI route.
    tokens: bool = True


@dataclass
class TokenData:
    """Token-level record of one generation, as training needs it.

    ``output_logprobs[i]`` is ``log_softmax(logits)[output_ids[i]]`` under the model's raw distribution
    at temperature 1 (no temperature, no top-p), i.e. the log-probability the *unmodified* policy gives
    the sampled token. ``version`` names the weights that produced every token.

    ``top_k`` (local engine with ``engine.top_k_logprobs`` > 0, else ``None``): per output token, the ``k`` most
    likely ids under that same distribution and their log-probs (:class:`~reef_core.topk.TopK`). It is
    binary data, kept out of :meth:`to_dict` (the JSON form stored in a record's payload); the record store keeps
    it packed in its own column (``Record.top_k``).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    version: str | None
    top_k: TopK | None = None

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k.tokens != len(self.output_ids):
            raise ValueError(f"top_k covers {self.top_k.tokens} tokens, the output has {len(self.output_ids)}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe form (no ``top_k``)."""
        return {
            "prompt_ids": list(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "output_logprobs": list(self.output_logprobs),
            "version": self.version,
        }

    def packed_top_k(self) -> bytes | None:
        """``top_k`` in the record store's binary form (:meth:`TopK.pack`), ``None`` when not captured."""
        return self.top_k.pack() if self.top_k is not None else None

    def to_event(self) -> dict[str, Any]:
        """The in-process form a stream's :data:`TOKENS_EVENT` carries: :meth:`to_dict` plus the ``top_k`` object
        (reef events never leave the process, so it needs no encoding)."""
        data = self.to_dict()
        if self.top_k is not None:
            data["top_k"] = self.top_k
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TokenData":
        """Inverse of :meth:`to_dict` and :meth:`to_event`; ``top_k`` may also be packed bytes."""
        return cls(
            prompt_ids=list(data["prompt_ids"]),
            output_ids=list(data["output_ids"]),
            output_logprobs=[float(x) for x in data["output_logprobs"]],
            version=data.get("version"),
            top_k=TopK.coerce(data.get("top_k")),
        )


@dataclass
class EngineResponse:
    """A complete (non-streamed) answer: status, JSON body and the headers worth relaying."""

    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)
    tokens: TokenData | None = None
    version: str | None = None


@dataclass
class StreamEvent:
    """One server-sent event. ``event`` is the SSE event name (Anthropic names its events; OpenAI does not)."""

    event: str | None
    data: dict | str  # parsed JSON, or the raw string (e.g. "[DONE]")

    @property
    def is_reef(self) -> bool:
        """True for Reef-internal events (``reef.*``) that must never reach a client."""
        return self.event is not None and self.event.startswith("reef.")


class DirectResponse(ReefError):
    """Raised by ``Engine.stream`` before any event when the provider answered without a stream.

    Carries the complete :class:`EngineResponse` (a relayed 4xx, or a JSON body) to send instead.
    """

    def __init__(self, response: EngineResponse):
        super().__init__(f"provider answered {response.status} without a stream")
        self.response = response
        self.status = response.status


class Engine(ABC):
    """Something that runs inference: an upstream provider or a local model."""

    name: str = "engine"
    dialects: tuple[Dialect, ...] = ()

    def preload(self) -> None:
        """Begin acquiring what :meth:`start` needs in the background (an embedded model's weights), so that it
        overlaps the rest of start-up; :meth:`start` then waits for it, :meth:`close` ends it. Optional: the default
        does nothing."""

    async def start(self) -> None:
        """Acquire resources (connection pool, model weights). Idempotent."""

    async def close(self) -> None:
        """Release resources. Idempotent."""

    @abstractmethod
    async def complete(self, req: EngineRequest) -> EngineResponse:
        """Run one non-streamed generation."""

    @abstractmethod
    def stream(self, req: EngineRequest) -> AsyncIterator[StreamEvent]:
        """Run one streamed generation (async generator).

        Raises UpstreamError / UpstreamTimeout on failure before or during the stream; a provider stream
        that ends without its terminal event raises ``UpstreamError("stream ended early")`` after yielding
        what arrived; raises :class:`DirectResponse` (before any event) when there is no stream to relay.
        """

    @abstractmethod
    async def count_tokens(self, req: EngineRequest) -> EngineResponse:
        """Count prompt tokens of an Anthropic-shaped body: ``{"input_tokens": n}``."""

    @abstractmethod
    def model_ids(self) -> list[str]:
        """Model names this engine answers for (may be empty when the provider decides)."""

    def check_dialect(self, req: EngineRequest) -> None:
        """Refuse a body in a dialect this engine does not speak (the server should have translated it)."""
        if req.dialect not in self.dialects:
            from reef_core.errors import ValidationFailed

            raise ValidationFailed(
                f"engine {self.name!r} speaks {', '.join(self.dialects)}, not {req.dialect}; "
                "translate the request first"
            )

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def relay_status(status: int) -> int:
    """Status the client sees for a provider 4xx: relayed ones unchanged, any other 4xx as 400."""
    return status if status in RELAYED_STATUSES else 400
