"""Built-in weights surface (registered through ``reef_register_surfaces``)."""

from __future__ import annotations

from .. import hookimpl


def make_weights_surface(*, ports, options=None):
    from ..surfaces.weights import WeightsSurface

    return WeightsSurface(ports, options)


@hookimpl
def reef_register_surfaces(register):
    register("weights", make_weights_surface, description="live weight updates on the embedded engine")
