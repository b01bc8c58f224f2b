"""Checkpoint and resume on the server. A checkpoint holds everything a resumed run needs to go on as
if never stopped: the global arrays, the strategy's state (its own, its components', the broadcast
data), the server's RNG states, and each client's own state, collected from the clients at checkpoint
time (Flower loses ``context.state`` when a run ends). After a resume each client gets its saved state
back with its messages until it answers once. Every message to a client with state also says the last
round whose update from it the server used, so that the client keeps the state of a fit only when its
update was used (``fedbr_flwr.core.algorithm.ClientAlgorithm.settle_pending``)."""

from __future__ import annotations

import io
import time
import zipfile
from datetime import datetime, timezone
from typing import Any, Callable

import numpy as np
from flwr.server.strategy import Strategy

from ..core.algorithm import UPDATE_USED
from ..core.config import common
from ..core.errors import ConfigError
from ..runfiles import codec
from ..runfiles.checkpoint import rng_state, save_checkpoint, set_rng_state
from ..runfiles.run_io import RunRecorder, code_hash
from .federation import Federation

Named = dict[str, np.ndarray]


class Checkpointer:
    def __init__(self, cfg: dict[str, Any], recorder: RunRecorder, federation: Federation, clients_have_state: bool):
        self.cfg = cfg
        self.recorder = recorder
        self.federation = federation
        self.clients_have_state = clients_have_state
        self.client_states: dict[int, bytes] = {}  # each client's own state, as last collected
        self.pending: dict[int, bytes] = {}  # after a resume: handed back until each client answers
        self.used_rounds: dict[int, int] = {}  # the last round whose update from each client was used
        self.resumed_round = 0  # the checkpoint's round when this run continues another
        self.saved_round = 0  # the round of the last checkpoint this run wrote
        self.completed: tuple[int, Named, Named] | None = None  # the last finished round: (round, global, state)
        self._to_restore: dict[str, np.ndarray] | None = None  # strategy state, restored after discovery

    def due(self, server_round: int) -> bool:
        run = common(self.cfg)
        every = run.checkpoint_every
        return bool(every) and (server_round % every == 0 or server_round == run.num_rounds)

    def save(self, server_round: int, global_arrays: Named, strategy_state: Named) -> None:
        start = time.perf_counter()
        if self.clients_have_state:
            self.collect_client_states()
        path = save_checkpoint(
            self.recorder.out_dir, self._arrays(global_arrays, strategy_state, rng_state()), self._header(server_round)
        )
        self.saved_round = server_round
        self.recorder.progress.emit(
            "checkpoint",
            f"round {server_round}: checkpoint saved to {path} ({time.perf_counter() - start:.2f} s)",
            round=server_round,
        )

    def _arrays(self, global_arrays: Named, strategy_state: Named, rng: Named) -> Named:
        return {
            **{f"global/{k}": v for k, v in global_arrays.items()},
            **strategy_state,
            **rng,
            **{f"client-state/{pid}": codec.to_uint8(b) for pid, b in self.client_states.items()},
        }

    def _header(self, server_round: int) -> dict[str, Any]:
        return {
            "round": server_round,
            "config": self.cfg,
            "elapsed": self.recorder.elapsed(),
            "git_commit": common(self.cfg).git_commit,
            "code_hash": code_hash(),
            "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }

    def round_completed(self, server_round: int, global_arrays: Named, strategy_state: Named) -> None:
        """Checkpoint ``server_round`` when one is due; else keep (copies of) what its checkpoint would hold, the
        RNG states too, for ``save_after_error``."""
        if self.due(server_round):
            self.save(server_round, global_arrays, strategy_state)
            return
        copied = {name: np.array(a, copy=True) for name, a in strategy_state.items()}
        self.completed = (server_round, global_arrays, {**copied, **rng_state()})

    def save_after_error(self, error: BaseException) -> None:
        """After an unexpected error, checkpoint the last finished round unless its checkpoint exists (whatever
        checkpoint-every says), and say so in one line; not where clients keep state of their own, which was
        collected at the last checkpoint (they may be past that round, or unreachable): a resume from the
        server's state of one round and the clients' of another would not be the run."""
        if self.completed is None or self.completed[0] <= self.saved_round:  # saved already, or later
            return
        server_round, global_arrays, strategy_state = self.completed
        out = self.recorder.out_dir
        failed = f"the run failed in round {server_round + 1} ({type(error).__name__}: {str(error)[:200]}); round"
        if self.clients_have_state:
            kept = max(self.saved_round, self.resumed_round)
            self.recorder.progress.emit(
                "error",
                f"{failed} {server_round} is not checkpointed, as its clients' own state is not at hand; "
                + (f"continue from round {kept} with `fedbr-run --resume {out}`" if kept else "start it again"),
                round=server_round,
            )
            return
        try:
            path = save_checkpoint(out, self._arrays(global_arrays, strategy_state, {}), self._header(server_round))
        except Exception as exc:  # noqa: BLE001 - the run is failing already: say why this failed too
            self.recorder.progress.emit(
                "error", f"the run failed ({error}) and round {server_round} could not be checkpointed: {exc}"
            )
            return
        self.saved_round = server_round
        self.recorder.progress.emit(
            "error",
            f"{failed} {server_round} is checkpointed to {path}: continue with `fedbr-run --resume {out}`",
            round=server_round,
        )

    def collect_client_states(self) -> None:
        """Ask every client for its own state; a client that cannot answer, or answers with bytes that are no
        named arrays, keeps the state it last sent."""
        answers = self.federation.request(
            "client-state",
            {pid: self.config_for(pid) for pid in self.federation.clients_by_pid},
            0,
            "its state for the checkpoint",
            state_problem,
        )
        for pid, arrays in answers.items():
            self.client_states[pid] = arrays["state"].tobytes()

    def resume_from(self, arrays: dict[str, np.ndarray], header: dict[str, Any], names: list[str]) -> Named:
        """Continue after the checkpoint's round: returns its global arrays (in the order of ``names``);
        the rest is restored after discovery."""
        self.resumed_round = int(header["round"])
        missing = [n for n in names if f"global/{n}" not in arrays]
        if missing:
            raise ConfigError(
                f"the checkpoint has no global array {missing[0]} ({len(missing)} missing): it was "
                "written by another algorithm or version"
            )
        self.client_states = {
            int(k.split("/")[1]): v.tobytes() for k, v in arrays.items() if k.startswith("client-state/")
        }
        self.pending = dict(self.client_states)
        self._to_restore = arrays
        return {n: arrays[f"global/{n}"] for n in names}

    def restore_after_discovery(self, restore_strategy: Callable[[Named], None]) -> None:
        if self._to_restore is None:
            return
        arrays, self._to_restore = self._to_restore, None
        restore_strategy(arrays)
        set_rng_state(arrays)
        self.recorder.progress.emit(
            "info", f"resumed after round {self.resumed_round} from {self.recorder.out_dir / 'checkpoint.npz'}"
        )

    def config_for(self, pid: int) -> dict[str, Any]:
        """What every message to client ``pid`` carries about its own state: the last round whose update was
        used (clients with state only), and after a resume its saved state until it answers."""
        config: dict[str, Any] = {UPDATE_USED: self.used_rounds.get(pid, 0)} if self.clients_have_state else {}
        return {**config, "client-state": self.pending[pid]} if pid in self.pending else config

    def updates_used(self, server_round: int, pids: list[int]) -> None:
        """The updates of ``pids`` went into round ``server_round``'s global arrays."""
        self.used_rounds.update({pid: server_round for pid in pids})

    def answered(self, pid: int) -> None:
        self.pending.pop(pid, None)


class ResumedRun(Strategy):
    """Flower numbers a resumed run's rounds from 1 again: this shifts them by the checkpoint's round,
    so that the strategy sees (and records) the rounds of the run it continues."""

    def __init__(self, strategy: Strategy, rounds_done: int):
        self.strategy = strategy
        self.offset = rounds_done

    def initialize_parameters(self, client_manager):
        return self.strategy.initialize_parameters(client_manager)

    def configure_fit(self, server_round, parameters, client_manager):
        return self.strategy.configure_fit(server_round + self.offset, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        return self.strategy.aggregate_fit(server_round + self.offset, results, failures)

    def configure_evaluate(self, server_round, parameters, client_manager):
        return self.strategy.configure_evaluate(server_round + self.offset, parameters, client_manager)

    def aggregate_evaluate(self, server_round, results, failures):
        return self.strategy.aggregate_evaluate(server_round + self.offset, results, failures)

    def evaluate(self, server_round, parameters):
        if server_round == 0:  # Flower's evaluation before its first round: the checkpoint's round, done already
            return None
        return self.strategy.evaluate(server_round + self.offset, parameters)


def state_problem(pid: int, arrays: Named) -> str | None:
    """Why a client's answer to the 'client-state' request cannot be kept: no 'state' array of bytes that
    decode as named arrays (what the client restores them from after a resume)."""
    state = arrays.get("state")
    if not isinstance(state, np.ndarray) or state.dtype != np.uint8 or state.ndim != 1:
        return "no 'state' array of bytes"
    data = state.tobytes()
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            expanded = sum(member.file_size for member in archive.infolist())
        if expanded > len(data):  # a client's state is stored, not compressed: a zip bomb would fill the memory
            return f"its state expands from {len(data)} to {expanded} bytes"
        codec.decode(data)
    except Exception as exc:  # noqa: BLE001 - any failure to decode is the reason
        return f"its state does not decode: {type(exc).__name__}: {str(exc)[:120]}"
    return None
