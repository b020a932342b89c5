"""Generated documentation; `python -m docs.generate --help` rebuilds it."""
