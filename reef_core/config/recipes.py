"""Every recipe a deployment serves, each with its own composition (``RecipeBinding``).

A recipe is more than its ``recipe`` section: its config file may also set ``trainer`` and ``evaluation``
(SAO sets ``trainer.grad_accumulation``, GEPA its gate). These three sections are *per recipe*; the others
(``server``, ``storage``, ``engine``, ``seed``, ``routes``, ``task``, ``learn``, and ``trainer.learner_workers``,
the size of the shared learner pool) are *deployment-wide* and always come from the top-level config.

* The default recipe (``+recipe=<name>`` on the command line, else ``none``) takes the top-level
  ``recipe``, ``trainer`` and ``evaluation`` sections, command-line overrides included.
* A routed recipe (``routes[i].recipe``) is composed on its own, ``+recipe=<name>`` plus the route's
  ``overrides`` (Hydra override strings such as ``trainer.lora=true``, ``evaluation.policy=floor``,
  ``+sao_profile=tiny``); top-level overrides do not reach it. Only its per-recipe sections are kept: what
  its composition says about deployment-wide sections is ignored, and a route override naming a
  deployment-wide key is refused at start-up (:class:`~reef_core.errors.ConfigError` naming the route).
* A route naming the default recipe shares the default binding, so it may carry no overrides; several routes
  naming the same recipe share one binding, so their overrides must agree. (A scenario stores only its
  recipe's name: one composition per recipe name keeps a restarted scenario on the sections it trained with.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .schema import EvaluationConfig, RecipeConfig, ReefConfig, RouteConfig, TrainerConfig

if TYPE_CHECKING:
    from ..plugins import PluginManager

#: The sections a recipe composes for itself (and a route's overrides may change).
RECIPE_SECTIONS = ("recipe", "trainer", "evaluation")
#: Keys inside those sections that stay deployment-wide (a route may not override them).
DEPLOYMENT_KEYS = {
    "recipe": "a route's recipe is routes[i].recipe",
    "recipe.name": "a route's recipe is routes[i].recipe",
    "trainer.learner_workers": "the learner pool is shared by every scenario of the deployment",
}
#: ``evaluation.publish`` values.
PUBLISH_MODES = ("auto", "review")


@dataclass(frozen=True)
class RecipeBinding:
    """One recipe as this deployment runs it: its per-recipe sections and the routes that select it."""

    name: str
    #: The ``recipe`` section: processor, trainer, surface, report_schema and their options.
    config: RecipeConfig
    #: The ``trainer`` section its trainer factory receives (``trainer=``).
    trainer: TrainerConfig
    #: The ``evaluation`` section of its gate: evaluator, policy, options, publish mode.
    evaluation: EvaluationConfig
    #: Patterns of the routes that select it (empty for the default recipe reached by no route).
    patterns: tuple[str, ...] = ()
    #: The route overrides it was composed with (empty for the default recipe).
    overrides: tuple[str, ...] = ()
    #: Whether this is the default recipe (top-level sections).
    default: bool = False

    def where(self) -> str:
        """How a message names this binding's config: the top level, or its routes."""
        if self.default:
            return "the top-level config"
        return f"the route(s) {', '.join(repr(p) for p in self.patterns)} to recipe {self.name!r}"

    def sections(self) -> dict:
        """The per-recipe sections as plain dicts (``reef config``)."""
        return {"patterns": list(self.patterns), "overrides": list(self.overrides),
                "recipe": dataclasses.asdict(self.config), "trainer": dataclasses.asdict(self.trainer),
                "evaluation": dataclasses.asdict(self.evaluation)}


def route_label(index: int, route: RouteConfig) -> str:
    return f"routes[{index}] (pattern {route.pattern!r}, recipe {route.recipe!r})"


def check_route(index: int, route: RouteConfig) -> None:
    """Refuse a route without a pattern or recipe, and overrides that name a deployment-wide key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    label = route_label(index, route)
    if not route.pattern:
        raise ConfigError(f"{label}: routes[{index}].pattern must not be empty")
    if not route.recipe:
        raise ConfigError(f"{label}: routes[{index}].recipe must name a recipe")
    try:
        parsed = OverridesParser.create().parse_overrides(list(route.overrides))
    except HydraException as exc:
        raise ConfigError(f"{label}: routes[{index}].overrides: {exc}") from None
    top_level = {f.name for f in dataclasses.fields(ReefConfig)} | {"hydra"}
    for override in parsed:
        key = override.key_or_group
        head = key.split(".", 1)[0]
        if key in DEPLOYMENT_KEYS:
            raise ConfigError(f"{label}: routes[{index}].overrides may not set {key!r}: {DEPLOYMENT_KEYS[key]}")
        if head in top_level and head not in RECIPE_SECTIONS:
            raise ConfigError(
                f"{label}: routes[{index}].overrides may not set {key!r}: {head} is deployment-wide (set it at the "
                f"top level); a route may change only {', '.join(s + '.*' for s in RECIPE_SECTIONS)} and select "
                f"config groups")
        # Anything else is a per-recipe key or a config group (``+sao_profile=tiny``): Hydra checks it when the
        # route's recipe is composed.


def recipe_bindings(cfg: ReefConfig, plugin_manager: PluginManager | None = None) -> dict[str, RecipeBinding]:
    """Recipe name -> binding: the default recipe from the top-level sections, each routed recipe composed from
    its own config group and its route's overrides. Raises :class:`ConfigError` naming the route at fault."""
    default = cfg.recipe
    found: dict[str, RecipeBinding] = {
        default.name: RecipeBinding(default.name, default, cfg.trainer, cfg.evaluation, default=True)}
    for index, route in enumerate(cfg.routes):
        check_route(index, route)
        label = route_label(index, route)
        overrides = tuple(route.overrides)
        known = found.get(route.recipe)
        if known is not None:
            if known.default and overrides:
                raise ConfigError(
                    f"{label}: recipe {route.recipe!r} is the default recipe, which takes the top-level sections; "
                    f"give its overrides at the top level, or route to it without overrides")
            if not known.default and overrides != known.overrides:
                raise ConfigError(
                    f"{label}: recipe {route.recipe!r} is also routed with overrides {list(known.overrides)}; "
                    f"routes naming one recipe share its composition, so their overrides must agree")
            found[route.recipe] = dataclasses.replace(known, patterns=known.patterns + (route.pattern,))
            continue
        from .compose import compose_config  # here: a deployment without routes never loads Hydra (config.apart)

        try:
            composed = compose_config([f"+recipe={route.recipe}", *overrides], plugin_manager)
        except ConfigError as exc:
            raise ConfigError(f"{label}: {exc.message}", **exc.details) from None
        if composed.recipe.name != route.recipe:
            raise ConfigError(f"{label}: its composition names recipe {composed.recipe.name!r}; a recipe's config "
                              f"file must set recipe.name to its own name")
        # The pool size is deployment-wide: the binding shows the value in force, not its composition's default.
        trainer = dataclasses.replace(composed.trainer, learner_workers=cfg.trainer.learner_workers)
        found[route.recipe] = RecipeBinding(route.recipe, composed.recipe, trainer, composed.evaluation,
                                            patterns=(route.pattern,), overrides=overrides)
    for binding in found.values():
        if binding.evaluation.publish not in PUBLISH_MODES:
            raise ConfigError(f"evaluation.publish of recipe {binding.name!r} ({binding.where()}) must be "
                              f"{' or '.join(repr(m) for m in PUBLISH_MODES)}, not {binding.evaluation.publish!r}")
    return found


def components(binding: RecipeBinding) -> list[tuple[str, str, str]]:
    """``(kind, name, config key)`` of every component the binding names (unset ones left out)."""
    named = [("report_schema", binding.config.report_schema, "recipe.report_schema"),
             ("processor", binding.config.processor, "recipe.processor"),
             ("trainer", binding.config.trainer, "recipe.trainer"),
             ("surface", binding.config.surface, "recipe.surface"),
             *(("surface", name, f"recipe.surfaces[{i}]") for i, name in enumerate(binding.config.surfaces or ())),
             ("selection_policy", binding.evaluation.policy, "evaluation.policy"),
             ("evaluator", binding.evaluation.evaluator, "evaluation.evaluator")]
    return [(kind, name, key) for kind, name, key in named if name]


def check_components(binding: RecipeBinding, plugin_manager: PluginManager) -> dict[str, str]:
    """Resolve every component the binding names (a ``module:Name`` path must import); kind -> name.

    Raises the registry's error (it lists the available names) prefixed with where the binding comes from."""
    from ..plugins import load_object
    from ..errors import ReefError

    checked = {}
    for kind, name, key in components(binding):
        try:
            if ":" in name:
                load_object(name)
            else:
                component = plugin_manager.get(kind, name)
                if component.requires:
                    from ..extras import require_modules

                    require_modules(dict(component.requires), f"{kind.replace('_', ' ')} {name!r}")
                if component.check_options is not None:  # a typo'd option: refused now, not on each step
                    component.check_options(recipe=binding.config)
        except ReefError as exc:
            if binding.default and not key.startswith("recipe.surfaces["):
                raise
            raise type(exc)(f"{binding.where()}: {key}: {exc.message}", **exc.details) from None
        checked[kind] = name
    return checked


def composite_parts(config, where: str = "") -> tuple[tuple[str, ...], tuple[str, ...], dict[str, dict]]:
    """A composite recipe's ``(surfaces, changes, options by surface)``; a ConfigError naming the key for a
    ``recipe.surfaces``/``changes``/``surface_options`` that cannot be served (``where``: the binding's prefix)."""
    surfaces, changes, options = list(config.surfaces or ()), list(config.changes or ()), config.surface_options or {}
    if config.surface:
        raise ConfigError(f"{where}recipe.surfaces: set either recipe.surface (one surface) or recipe.surfaces "
                          f"(several), not both")
    if len(surfaces) < 2:
        raise ConfigError(f"{where}recipe.surfaces: a composite names two or more surfaces; one is recipe.surface")
    if any(not isinstance(n, str) or not n for n in surfaces) or len(set(surfaces)) != len(surfaces):
        raise ConfigError(f"{where}recipe.surfaces: a list of distinct surface names, not {surfaces!r}")
    outside = [n for n in changes if n not in surfaces]
    if outside or len(set(changes)) != len(changes):
        raise ConfigError(f"{where}recipe.changes: names the surfaces of recipe.surfaces ({', '.join(surfaces)}) its "
                          f"candidates change, once each; not {outside[0] if outside else changes!r}")
    for name, value in options.items():
        if name not in surfaces or not isinstance(value, dict):
            raise ConfigError(f"{where}recipe.surface_options.{name}: with recipe.surfaces, surface_options maps "
                              f"each of {', '.join(surfaces)} to its options")
    return tuple(surfaces), tuple(changes or surfaces[:1]), {n: dict(options.get(n) or {}) for n in surfaces}
