"""The learnable demo of reef-openclaw: a scripted user with a style preference (see :mod:`.style`)."""
