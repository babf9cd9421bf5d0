"""reef-openclaw: OpenClaw-RL: learn from what happens after each reply, with no explicit reports."""
