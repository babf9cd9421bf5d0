"""Problems shipped with reef-ttt: each is a task object (seeds, prompts, a verifier, an optional executor).

See :mod:`reef_ttt.task` for the contract and :mod:`reef_ttt.tasks.circle_packing` for the circle-packing task.
"""
