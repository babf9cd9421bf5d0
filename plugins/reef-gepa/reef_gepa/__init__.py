"""reef-gepa: GEPA (arXiv:2507.19457): evolve the agent's prompts from scores and textual feedback.

The trainer (:class:`reef_gepa.trainer.GepaTrainer`) runs gepa's own Pareto sampling, minibatch
sampler, reflective proposer and merge on a persistent archive, one iteration per batch of
reports; ``reef_gepa.examples`` holds runnable tasks, verifiers and stand-in models.
"""
