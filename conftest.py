"""Root conftest: the shared Reef fixtures for tests/ and every plugins/*/tests/."""

pytest_plugins = ["reef_core.testing.fixtures"]
