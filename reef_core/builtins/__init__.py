"""Reef's built-in components, registered through the same hooks third-party plugins use.

Factories import their implementation lazily so that listing plugins stays cheap.
"""
