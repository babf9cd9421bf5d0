"""Built-in harness surface (registered through ``reef_register_surfaces``)."""

from __future__ import annotations

from .. import hookimpl


def make_harness_surface(*, ports=None, options=None):
    """``ports`` (a ``ServingPorts``) gives the artifact store the surface restores heads from."""
    from ..surfaces.harness import HarnessSurface

    return HarnessSurface(ports.artifacts if ports is not None else None, options)


@hookimpl
def reef_register_surfaces(register):
    register("harness", make_harness_surface,
             description="a text tree (prompts, rules, skills) pulled by clients or injected as the system prompt")
