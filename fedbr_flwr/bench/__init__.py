"""The bench wing: ``fedbr-bench`` (``command``), the bare loop Flower's runs are measured against (``bare``),
where a whole run's seconds go (``startup``) and the same workload in pfl-research (``startup_pfl``). Nothing
outside this package imports it."""

from .command import main

__all__ = ["main"]
