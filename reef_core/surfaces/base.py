"""The surface contract.

A surface component (registered through ``reef_register_surfaces``) is built once per distinct
``recipe.surface_options`` among the recipes naming it (a ``weights`` surface once per deployment: the engine
has one set of weights) by ``factory(ports=<ServingPorts>, options=<dict>)`` (the engine,
the artifact store, ``run_async`` and the base-model loader; never the whole deployment) and serves every scenario
whose recipe names it in ``recipe.surface`` with those options. The learner calls :meth:`Surface.activate` after a
release is committed (or at start-up, to restore the head); the request path calls
:meth:`prepare_request` and :meth:`response_headers` for each inference of such a scenario.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol


class RunAsync(Protocol):
    """Run ``coroutine`` on the server's event loop from a worker thread and return its result."""

    def __call__(self, coroutine: Coroutine[Any, Any, Any], timeout: float | None = 600) -> Any: ...


@dataclass(frozen=True)
class ServingPorts:
    """What a surface may use: it makes releases reach live requests, nothing more."""

    #: The deployment's ``reef_core.engines.base.Engine``.
    engine: Any
    #: Where releases live (the built-in is ``GitArtifactStore``); None in tests that need none.
    artifacts: Any
    run_async: RunAsync
    #: ``() -> (model, tokenizer)``: the base model the local engine serves (weights surfaces).
    load_base_model: Callable[[], tuple[Any, Any]]


class Surface(ABC):
    #: ``weights``, ``harness`` or ``none``.
    kind: str = "none"

    def validate(self, files: Mapping[str, Any]) -> None:
        """Refuse a release that must not be published (raise ``ValidationFailed``)."""

    def validate_successor(self, files: Mapping[str, Any], previous: Callable[[], Mapping[str, Any]]) -> None:
        """Refuse a trainer's candidate ``files`` as the successor of the serving release (``previous()`` reads
        its files); e.g. a skill pool that would lose a skill. Called by the gate after :meth:`validate`."""

    def warm(self) -> None:
        """Once per process, at start-up and off the request path: work that a scenario's first request would
        otherwise wait for (e.g. the weights surface's base-model digest). Nothing by default."""

    def creation_files(self) -> Mapping[str, Any]:
        """The files of a new scenario's first release (``creation``) when its trainer seeds none.

        Empty: the surface has nothing to say about a scenario's start (no creation release)."""
        return {}

    def activate(self, scenario: str, release_id: str | None, payload: Any = None,
                 files: Callable[[], Mapping[str, bytes]] | None = None) -> None:
        """Make ``release_id`` what serves ``scenario`` from the next request on.

        ``payload`` is the candidate's in-memory form when activation follows training;
        ``files()`` reads the release from the artifact store (restore, rollback). A release that
        cannot be served raises and leaves what served before in place: the learner then restores
        the head to that release (see ``ScenarioLearner._activate_committed``)."""

    def serving_version(self, scenario: str) -> str | None:
        """The version an inference of ``scenario`` would be served by right now."""
        return None

    def prepare_request(self, scenario: str, dialect: str, body: dict) -> tuple[dict, str | None]:
        """Rewrite a request before the engine sees it; return it and the release that shaped it."""
        return body, None

    def response_headers(self, scenario: str, release_id: str | None) -> dict[str, str]:
        """Headers added to every inference response of the scenario."""
        return {}
