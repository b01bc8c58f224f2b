"""The FLOPs of a fit, counted by torch's ``FlopCounterMode``: its formulas for the matrix products and convolutions
that run (2 FLOPs a multiply-add; elementwise work is not counted)."""

from __future__ import annotations

from typing import Any

from torch.utils.flop_counter import FlopCounterMode


class _GlobalOnly:
    """Stands in for ``FlopCounterMode``'s module tracker: every count goes to the total ("Global") alone. The
    tracker's backward hooks on each module's inputs break a ``torch.func.grad`` taken inside a step (FedMix's
    input gradient: "A leaf node was passed to _will_engine_execute_node"), and the bench reads only the total."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class FitFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` counting the total only (``get_total_flops``), with no module hooks."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.mod_tracker = _GlobalOnly()  # type: ignore[assignment]
