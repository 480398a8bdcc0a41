"""One `get_config()` per experiment; each docstring holds its launch command."""
