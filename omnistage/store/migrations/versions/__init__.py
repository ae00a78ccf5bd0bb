"""One module per schema revision, oldest first (see the package docstring)."""
