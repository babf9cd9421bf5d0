"""The GEPA recipe's knobs (``recipe.options``), with defaults from the paper and gepa 0.1.4.

:class:`GepaOptions` is the one place these defaults live; ``conf/recipe/gepa.yaml`` states only the demo's
choices and the values other sections interpolate.

Keys may be snake_case or kebab-case. Unknown keys are a :class:`ConfigError`, so a misspelled knob
never silently leaves a default in place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reef_core.api import ConfigError, option_values, validate_harness_path, ValidationFailed

SELECTORS = ("pareto", "current_best", "epsilon_greedy", "top_k_pareto")
MODULE_SELECTORS = ("round_robin", "all")
ACCEPTANCE = ("strict_improvement", "improvement_or_equal")


@dataclass
class GepaOptions:
    #: Reports per reflection (also the processor's batch size).
    minibatch_size: int = 3
    #: Seed of the rng shared by Pareto parent sampling, minibatch shuffling and merge (None: the config seed).
    seed: int | None = None
    #: Harness files GEPA evolves (its named components), round-robin one per iteration.
    components: list[str] = field(default_factory=lambda: ["system_prompt.md"])
    #: Files forming the system prompt a task runs with (None: the components); match the surface's.
    system_files: list[str] | None = None
    #: The scenario's first release (path -> text).
    initial_files: dict[str, str] = field(default_factory=dict)
    #: Held-out validation tasks: per-task Pareto fronts, and the gate's eval_tasks. Required.
    valset: Any = None
    #: Optional training tasks: minibatches are sampled from them as upstream does (EpochShuffledBatchSampler);
    #: without them the minibatch is the batch of reported traffic.
    trainset: Any = None
    #: ``pkg.mod:fn`` with ``fn(output, task) -> float | bool | None``: GEPA's metric. Required.
    verifier: str | None = None
    #: ``pkg.mod:fn`` with ``fn(task, output, score) -> str``: the reflection signal (default restates the score).
    feedback: str | None = None
    #: Task and reflection models: null/'served', a dotted callable, or {url, model, api_key_env}.
    task_model: Any = None
    reflection_model: Any = None
    #: Replacement for gepa's instruction-proposal template (must hold <curr_param> and <side_info>).
    reflection_prompt_template: str | None = None
    max_metric_calls: int | None = None
    skip_perfect_score: bool = True
    perfect_score: float = 1.0
    candidate_selection_strategy: str = "pareto"
    module_selector: str = "round_robin"
    acceptance: str = "strict_improvement"
    frontier_type: str = "instance"
    use_merge: bool = False
    max_merge_invocations: int = 5
    merge_val_overlap_floor: int = 5
    #: Outputs remembered per (system prompt, task) so the gate re-uses GEPA's validation runs (0: off).
    output_cache_size: int = 20000

    @classmethod
    def from_config(cls, options: Mapping[str, Any] | None) -> "GepaOptions":
        """Parse ``recipe.options`` (a plain mapping); unknown keys are a :class:`ConfigError`."""
        opts = cls(**option_values(cls, options, who="gepa"))
        opts._check()
        return opts

    def _check(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(f"gepa: {message}")

        need(isinstance(self.minibatch_size, int) and self.minibatch_size >= 1, "minibatch_size must be >= 1")
        need(self.verifier is not None, "options.verifier (pkg.module:function) is required")
        need(self.valset is not None, "options.valset (held-out validation tasks) is required")
        need(isinstance(self.components, list) and len(self.components) > 0, "components must be a non-empty list")
        self.components = [str(c) for c in self.components]
        self.system_files = [str(p) for p in self.system_files] if self.system_files else list(self.components)
        self.initial_files = {str(k): str(v) for k, v in dict(self.initial_files or {}).items()}
        try:
            for path in [*self.components, *self.system_files, *self.initial_files]:
                validate_harness_path(path)
        except ValidationFailed as exc:
            raise ConfigError(f"gepa: {exc.message}") from None
        need(self.candidate_selection_strategy in SELECTORS,
             f"candidate_selection_strategy must be one of {', '.join(SELECTORS)}")
        need(self.module_selector in MODULE_SELECTORS, f"module_selector must be one of {', '.join(MODULE_SELECTORS)}")
        need(self.acceptance in ACCEPTANCE, f"acceptance must be one of {', '.join(ACCEPTANCE)}")
        # The other frontier types need per-objective scores, which a scalar verifier does not give.
        need(self.frontier_type == "instance", "frontier_type must be 'instance'")
        need(self.max_metric_calls is None or int(self.max_metric_calls) > 0, "max_metric_calls must be positive")
        need(math.isfinite(float(self.perfect_score)), "perfect_score must be finite")
        need(int(self.max_merge_invocations) >= 0 and int(self.merge_val_overlap_floor) > 0,
             "max_merge_invocations must be >= 0 and merge_val_overlap_floor > 0")
        if self.reflection_prompt_template is not None:
            from gepa.strategies.instruction_proposal import InstructionProposalSignature

            try:
                InstructionProposalSignature.validate_prompt_template(self.reflection_prompt_template)
            except ValueError as exc:
                raise ConfigError(f"gepa: reflection_prompt_template: {exc}") from None
