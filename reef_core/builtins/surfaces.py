"""Built-in harness surface (registered through ``reef_register_surfaces``)."""

from __future__ import annotations

from .. import hookimpl


def make_harness_surface(*, deployment=None, options=None):
    from ..surfaces.harness import HarnessSurface

    return HarnessSurface(deployment, options)


@hookimpl
def reef_register_surfaces(register):
    register("harness", make_harness_surface,
             description="a text tree (prompts, rules, skills) pulled by clients or injected as the system prompt")
