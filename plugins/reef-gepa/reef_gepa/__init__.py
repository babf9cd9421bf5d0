"""reef-gepa: GEPA (arXiv:2507.19457): evolve the agent's prompts from scores and textual feedback."""
