"""``trainer.backend=slime``: weight steps run as slime training jobs (see :mod:`.trainer`, :mod:`.marker`)."""
