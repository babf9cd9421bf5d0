"""The real-engine tests: a package, so that the fixtures scoped to it (the tiny model's vLLM) end with it."""
