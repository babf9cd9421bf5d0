"""Built-in processors (registered through hooks)."""
