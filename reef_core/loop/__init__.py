"""The loop: the running deployment (assembly, scenarios) and the learner that grows and commits."""
