"""Command-line launchers: thin wrappers around library functions.

Started as `python -m experiments.<launcher>`, the package first re-executes
the process with tcmalloc preloaded when it is installed (see
`experiments.allocator`), before any launcher imports JAX.
"""

from experiments.allocator import reexec_with_tcmalloc

reexec_with_tcmalloc()
