"""Surfaces: how a published release reaches live requests (weights, harness text)."""
