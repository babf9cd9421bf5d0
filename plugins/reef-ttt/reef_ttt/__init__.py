"""reef-ttt: TTT-Discover and Guidance-TTT: test-time training on one problem from complete grids of verifier-scored
rollouts, with a PUCT archive; ships circle packing (see the package README)."""
