"""Fixtures live in reef_core.testing.fixtures (loaded by the root conftest.py)."""
