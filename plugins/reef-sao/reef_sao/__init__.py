"""reef-sao: SAO (arXiv:2607.07508): learn model weights from a stream of tasks scored by tests or a verifier."""
