"""reef-ttt: TTT-Discover and Guidance-TTT: test-time training on grouped, continuously scored rollouts."""
