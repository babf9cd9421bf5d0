"""Built-in storage (registered through hooks)."""
