"""Models on this machine: loading, conversion, the cache and the devices they run on.

:mod:`.loading` finds, fetches, converts and loads a causal LM (the tiny test model, SmolLM2, a local directory or a
hub id) and reads its generation defaults; :mod:`.device` parses and checks ``engine.device`` / ``trainer.device``.
Both the engines (serving) and grow/ (training) import this package; it imports neither.
"""
