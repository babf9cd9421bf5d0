"""Client names as the HTTP routes read them: the scenario header, scenario path segments and record ids.

The rules themselves are :mod:`reef_core.names`. A new name must follow them; a name in a URL path is only
looked up, so a scenario stored before today's rule (say with a TAB) stays readable and can be archived.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from reef_core.errors import Forbidden, NotFound, ValidationFailed
from reef_core.observe.model import MAX_ID_LENGTH as STORED_ID_LENGTH
from reef_core.serve.middleware.tenancy import check_scenario
from reef_core.wire import PIN_HEADER, RECORD_ID_HEADER, SCENARIO_HEADER  # noqa: F401 - read here
from reef_core.names import check_record_id, check_scenario_name, header_text, is_record_id, scenario_problem



def single_header(request: Request, header: str) -> str | None:
    """The value of ``header``, or None when absent. Sent twice with different values, it is a 400: which one a
    proxy, the token check and the route would each read is not ours to guess (repeated identical ones are one)."""
    values = request.headers.getlist(header)
    if not values:
        return None
    if any(value != values[0] for value in values[1:]):
        raise ValidationFailed(f"{header} is sent {len(values)} times with different values; send it once",
                               param=header)
    return values[0]


def scenario_header(request: Request) -> str:
    """The ``x-reef-scenario`` header, decoded as UTF-8 and checked against the scenario-name rule (400 if not)
    and the token's scenario patterns (403 if outside them)."""
    raw = single_header(request, SCENARIO_HEADER)
    if raw is None or not raw.strip():
        raise ValidationFailed(f"missing or empty {SCENARIO_HEADER}", field=SCENARIO_HEADER)
    name = check_scenario_name(header_text(raw, SCENARIO_HEADER), SCENARIO_HEADER)
    check_scenario(request.scope, name)  # a token confined to other scenarios: 403 naming this one
    return name


def optional_id_header(request: Request, header: str) -> str | None:
    """A client-chosen id header (receipt, ``Idempotency-Key``), checked against the id grammar, or None."""
    raw = single_header(request, header)
    if raw is None:
        return None
    return check_record_id(header_text(raw, header), header)


#: The scopes that may pin a release per request (``x-reef-release``).
PIN_SCOPES = frozenset({"admin", "pin"})


def pin_header(request: Request, principal) -> str | None:
    """The ``x-reef-release`` pin (an alias or a release id), or None: 403 naming it for a token without the
    ``admin`` or ``pin`` scope, 400 for a value that is no name at all. What it names is resolved later, before
    anything is created (:meth:`~reef_core.loop.deployment.Deployment.pinned_release`)."""
    raw = single_header(request, PIN_HEADER)
    if raw is None:
        return None
    if not PIN_SCOPES & principal.scopes:
        raise Forbidden(f"{PIN_HEADER}: token {principal.name!r} may not pin a release (it needs the admin or pin "
                        "scope)", param=PIN_HEADER)
    value = header_text(raw, PIN_HEADER).strip()
    if not value or len(value) > 200:
        raise ValidationFailed(f"{PIN_HEADER}: an alias name or a release id of at most 200 characters",
                               param=PIN_HEADER)
    return value


def _storable_lookup(value: str) -> bool:
    # Only strings a stored row could hold are looked up (PostgreSQL refuses NUL in text parameters).
    return "\x00" not in value and len(value) <= STORED_ID_LENGTH


async def path_scenario(dep, name: str, *, archived: bool = False):
    """The stored scenario a URL path names (archived ones only when ``archived``): 400 for a name the rule
    refuses and no row holds, 404 for a valid name that is unknown."""
    problem = scenario_problem(name)
    found = await asyncio.to_thread(dep.find_scenario, name) if _storable_lookup(name) else None
    if found is None or (found.archived and not archived):
        if problem is not None:
            check_scenario_name(name, "scenario")
        raise NotFound(f"unknown scenario {name!r}")
    return found


async def path_record(dep, scenario: str, record_id: str):
    """The record ``{id}`` of ``scenario`` names: 400 for an id outside the grammar that no row holds, else 404."""
    found = await asyncio.to_thread(dep.find_record, scenario, record_id) if _storable_lookup(record_id) else None
    if found is None:
        if not is_record_id(record_id):
            check_record_id(record_id, "record_id")
        raise NotFound(f"no record {record_id!r} in scenario {scenario!r}")
    return found
