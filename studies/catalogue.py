"""Every study the launcher runs (`python -m experiments.study NAME`), by name.

Each entry is a `studies.results.Study`: how it trains and measures, and
the table and plot of its results. docs/experiments.md shows each one's results
with the command that regenerates them.
"""

from __future__ import annotations

from studies import (
    circuits,
    finetuning,
    language_model,
    lm_positions,
    mechanisms,
    sinks,
    variants,
    windows,
)
from studies.results import Study

__all__ = ["STUDIES"]

STUDIES: dict[str, Study] = {
    **language_model.STUDIES,
    **mechanisms.STUDIES,
    **finetuning.STUDIES,
    **circuits.STUDIES,
    **variants.STUDIES,
    **lm_positions.STUDIES,
    **sinks.STUDIES,
    **windows.STUDIES,
}
