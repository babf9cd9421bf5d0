"""The server process: ``reef serve`` itself, its worker processes and how they forward to the primary, and its
log output."""
