"""Built-in harness and skill surfaces (``reef_register_surfaces``) and harness adapters
(``reef_register_harness_adapters``)."""

from __future__ import annotations

from .. import hookimpl


def make_harness_surface(*, ports=None, options=None):
    """``ports`` (a ``ServingPorts``) gives the artifact store the surface restores heads from."""
    from ..surfaces.harness import HarnessSurface

    return HarnessSurface(ports.artifacts if ports is not None else None, options)


def make_skill_surface(*, ports=None, options=None):
    """A harness surface whose releases are skill pools (``skills/<slug>/SKILL.md``)."""
    from ..surfaces.skills import SkillSurface

    return SkillSurface(ports.artifacts if ports is not None else None, options)


@hookimpl
def reef_register_surfaces(register):
    register("harness", make_harness_surface,
             description="a text tree (prompts, rules, skills) pulled by clients or injected as the system prompt")
    register("skills", make_skill_surface,
             description="a shared skill pool (skills/<slug>/SKILL.md); its catalog is injected into every request")


@hookimpl
def reef_register_harness_adapters(register):
    from ..surfaces.adapters import GenericAdapter, OpenCodeAdapter

    register("generic", GenericAdapter, description=GenericAdapter.description)
    register("opencode", OpenCodeAdapter, description=OpenCodeAdapter.description)
