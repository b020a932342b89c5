"""Command-line launchers: thin wrappers around library functions."""
