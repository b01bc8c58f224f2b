"""FedAvg's server, and the hooks an algorithm's strategy overrides. Every hook receives and returns
plain Python: partition ids, named arrays (``{name: ndarray}``), metric dicts, ``ClientUpdate``s. The
Flower adapter and the round's machinery (discovery, fault filtering, recording, checkpoints) are in
``fedbr_flwr.server``; the algorithm's model, settings and components come through the registry.

Hooks, in the order a round calls them:
``before_round`` (the broadcast data: ``make_shared_data``, ``shared_is_stale``), ``round_arrays`` (sent to
every sampled client: SCAFFOLD's c; components add theirs, e.g. FedCM's Delta), ``client_arrays`` (to one
client: DisTrans' offset), ``fit_config``, ``after_answers``, ``aggregation_weights`` (``weighting``),
``judged_groups`` (what Krum and norm-bound judge beside the model update), ``aggregate`` (the new global
arrays), ``after_aggregate``; and ``after_discovery`` (once), ``global_test_module``, ``reported_arrays`` (the
model evaluated), ``checkpoint_state`` / ``restore_state`` (what a checkpoint holds beyond the global arrays)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedbr_flwr.app.strategy import FlowerStrategy
from fedbr_flwr.core.algorithm import client_class
from fedbr_flwr.core.broadcast import SharedData
from fedbr_flwr.core.config import common, components_of
from fedbr_flwr.core.registry import lookup_strategy, settings_of
from fedbr_flwr.core.settings import NoSettings, Settings
from fedbr_flwr.core.training import module_arrays
from fedbr_flwr.data.dataset import ServerTests
from fedbr_flwr.runfiles import codec
from fedbr_flwr.runfiles.run_io import RunRecorder
from fedbr_flwr.server.components import server_component_class
from fedbr_flwr.server.robust import AggregationRound, JudgedGroup
from fedbr_flwr.server.updates import ClientUpdate, all_finite

Named = dict[str, np.ndarray]


class FederatedStrategy(FlowerStrategy):
    """FedAvg's behaviour: the global arrays are the (uniform or sample-weighted) mean of the returned ones."""

    name = ""  # set by register_strategy
    # an algorithm whose settings only its server reads may declare them here instead of in its client
    Settings: type[Settings] = NoSettings
    shared_name = ""  # the data it broadcasts to every client, if any (FedBR: "pseudo"): ``self.shared``

    def __init__(
        self,
        cfg: dict[str, Any],
        recorder: RunRecorder,
        modules: dict[str, torch.nn.Module],
        server_tests: ServerTests | None,
    ):
        self.client_class = client_class(common(cfg).strategy)
        super().__init__(cfg, recorder, bool(self.client_class.state_keys))
        self.settings: Any = settings_of(self.name).from_config(cfg)  # its own class: read by each strategy file
        self.modules = modules  # the global model (and FedBR's head, DANN's discriminator), as clients build them
        self.model = modules["model"]
        self.server_tests = server_tests  # what the server evaluates the global model on (None: nothing)
        initial = self.initial_arrays()
        self.global_names = list(initial)
        self.shared = SharedData(self.shared_name) if self.shared_name else None  # FedBR's, FedMix's, VHL's
        self.components = [cls(cfg, initial) for name in components_of(cfg) if (cls := server_component_class(name))]

    @property
    def resumed_round(self) -> int:
        return self.checkpointer.resumed_round

    def resume_from(self, arrays: Named, header: dict[str, Any]) -> None:
        """Continue after the checkpoint's round: its global arrays at once, the rest after discovery."""
        self.latest = self.checkpointer.resume_from(arrays, header, self.global_names)

    # ------------------------------------------------------------ hooks
    def initial_arrays(self) -> Named:
        """The global arrays before round 1: '<module>/<key>' of every module that travels."""
        return {name: a for prefix, m in self.modules.items() for name, a in module_arrays(prefix, m).items()}

    def returned_shapes(self) -> dict[str, tuple[int, ...]]:
        """What clients return beside the global arrays (declared by the algorithm's client side)."""
        return self.client_class.returned_shapes(self.model, self.cfg)

    def before_round(self, server_round: int) -> None:
        if self.shared is not None and self.shared_is_stale(server_round):
            self.refresh_shared_data(server_round)

    def round_arrays(self, server_round: int, global_arrays: Named) -> Named:
        """Arrays sent to every sampled client this round beside the global ones (serialised once)."""
        return {name: a for c in self.components for name, a in c.round_arrays(server_round, global_arrays).items()}

    def client_arrays(self, pid: int) -> Named:
        """Arrays sent to client ``pid`` alone, with fit and evaluate instructions (DisTrans' offset)."""
        return {}

    def fit_config(self, server_round: int, pid: int) -> dict[str, Any]:
        shared = self.shared.fit_config(pid) if self.shared is not None else {}
        return {"server-round": server_round, **shared, **self.checkpointer.config_for(pid)}

    def after_answers(self, metrics: dict[int, dict]) -> None:
        """Every fit answer's metrics by partition id, before any is screened."""
        if self.shared is not None:
            self.shared.confirm(metrics, self.sampled)

    def aggregation_weights(self, updates: list[ClientUpdate]) -> list[float]:
        """One weight per update, in order (GroupDRO's come from the clients' losses)."""
        return [u.num_examples if common(self.cfg).weighting == "samples" else 1.0 for u in updates]

    @classmethod
    def may_judge_groups(cls, cfg: dict[str, Any]) -> bool:
        """Whether ``judged_groups`` may name arrays in a run of (validated) ``cfg``: the config checks ask before
        any strategy is built."""
        return False

    def judged_groups(self) -> tuple[JudgedGroup, ...]:
        """The arrays clients return beside the model update that ``aggregate`` averages: Krum and norm-bound
        judge each client on them too (SCAFFOLD's control-variate changes, DisTrans' offsets under ``avg``)."""
        return ()

    def aggregate(self, rnd: AggregationRound) -> Named:
        """The new global arrays from the round's accepted updates (``rnd.combine``: every mean goes through it)."""
        return rnd.combine(self.global_names, relative_to=rnd.sent)

    def finite_or_kept(self, rnd: AggregationRound, what: str, new: Named, old: Named, *derived: Named) -> Named:
        """``new`` server state, or ``old`` with a warning where it or arrays ``derived`` from it hold Inf or NaN:
        accepted but huge updates can sum past float32's largest, and every client would be sent Inf from then on."""
        if all_finite(new, *derived):
            return new
        self._warn(rnd.number, [f"{what} would hold Inf: it is kept"])
        return old

    def after_aggregate(self, new_global: Named) -> list[str]:
        """The components' ``after_aggregate``; their warnings."""
        return [line for component in self.components for line in component.after_aggregate(new_global)]

    def after_discovery(self) -> dict[str, Any]:
        """Called once every client has reported its partition; returns extra manifest entries."""
        return {}

    def global_test_module(self) -> torch.nn.Module:
        """What the server evaluates on the global test set, once ``self.model`` holds the new weights."""
        return self.client_class.predictor(self.model, self.cfg)

    def reported_arrays(self, served: Named) -> Named:
        """The global arrays whose model is evaluated and reported (on the clients' local test sets and the
        global test set), given those the clients train from (``served``); FedDyn's authors report another
        model. Returning ``served`` itself: the same."""
        return served

    def make_shared_data(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) to broadcast as ``self.shared``; called before round 1 and whenever ``shared_is_stale``."""
        raise NotImplementedError

    def shared_data(self) -> SharedData:
        """``self.shared``, for the hooks that run only where a strategy broadcasts data."""
        if self.shared is None:
            raise RuntimeError(f"{type(self).__name__} broadcasts no data: self.shared is None")
        return self.shared

    def shared_is_stale(self, server_round: int) -> bool:
        return self.shared_data().arrays is None

    def refresh_shared_data(self, server_round: int) -> None:
        """Build the broadcast data anew; it is saved as <name>_data.npz in the run folder."""
        x, y = self.make_shared_data(server_round)
        shared = self.shared_data()
        shared.publish(x, y, server_round)
        codec.write(
            self.recorder.out_dir / f"{shared.name}_data.npz", {"x": x, "y": y, "version": np.asarray(server_round)}
        )

    def checkpoint_state(self) -> Named:
        """What a checkpoint holds beyond the global arrays; subclasses add theirs to this."""
        state = {name: a for c in self.components for name, a in c.checkpoint_state().items()}
        if self.shared is not None and self.shared.arrays is not None:
            x, y = self.shared.arrays
            state.update({"shared/x": x, "shared/y": y, "shared/version": np.array(self.shared.version)})
        return state

    def restore_state(self, arrays: Named) -> None:
        """The inverse of ``checkpoint_state``; called after discovery, before the first resumed round."""
        for component in self.components:
            component.restore_state(arrays)
        if self.shared is not None and "shared/x" in arrays:  # clients lost it with the old run: all are sent it
            self.shared.publish(arrays["shared/x"], arrays["shared/y"], int(arrays["shared/version"]))


def strategy_class(name: str) -> type[FederatedStrategy]:
    """The server side of algorithm ``name`` (else of what it builds on, ``registry.lineage``; else FedAvg's)."""
    return lookup_strategy(name)
