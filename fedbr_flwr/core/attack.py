"""Simulated Byzantine clients, for experiments (Flower-free): which clients attack, and what they send.

The attackers are a function of the config alone (``attack-ids``, or ``attack-clients`` drawn from the run
seed), so every node and the server agree on them without a message. An attacker trains as usual (on flipped
labels under ``label-flip``) and then changes its reply: each floating array the server sent it, w, becomes
(with g the global array it received and Delta = w - g):

* ``sign-flip``: g - factor * Delta
* ``scale``: g + factor * Delta
* ``noise``: g + sigma * z, z standard normal, its own draw (run seed, round, partition)
* ``collude``: g + sigma * z with one draw per round (run seed, round): every attacker sends the same update,
  without talking to the others
* ``label-flip``: its reply as trained, on training labels y -> C - 1 - y

Integer arrays (BatchNorm's counters) go as trained. The arrays a client returns beyond the ones it was sent
(SCAFFOLD's control-variate change; DisTrans' offset where the server sent none: round 1, or every round
under distrans-agg=none) go as trained too under ``attack-arrays=model``, and under ``all`` are poisoned
alike, each taken as a change from zero (g = 0)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import seeds
from .config import common, parse_ids

Named = dict[str, np.ndarray]


def attackers(cfg: Mapping[str, Any]) -> list[int]:
    """The partition ids that attack, in order (none without an attack, or before num-clients is known)."""
    run = common(cfg)
    if run.attack == "none":
        return []
    if run.attack_ids:
        return parse_ids(run.attack_ids)
    n = run.num_clients
    if not n:
        return []
    count = min(run.attack_clients, n)
    return sorted(int(p) for p in seeds.rng("attackers", run.seed).choice(n, count, replace=False))


def attack_manifest(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's record of the run's simulated attack (none without one)."""
    run = common(cfg)
    if run.attack == "none":
        return {}
    kind = {"kind": run.attack, "clients": attackers(cfg)}
    return {"attack": {**kind, "factor": run.attack_factor, "noise": run.attack_noise, "arrays": run.attack_arrays}}


def attackers_that_answered(cfg: Mapping[str, Any], answered: set[int]) -> dict[str, Any]:
    """The rounds.jsonl record of the round's attacking clients (none without an attack)."""
    return {} if common(cfg).attack == "none" else {"attackers": sorted(set(attackers(cfg)) & answered)}


def flipped_labels(y: Any, num_classes: int) -> Any:
    """Label flipping: y -> C - 1 - y."""
    return num_classes - 1 - y


def is_label_flipper(cfg: Mapping[str, Any], pid: int) -> bool:
    return common(cfg).attack == "label-flip" and pid in attackers(cfg)


def poisoned(
    reply: Named, sent: Mapping[str, np.ndarray], cfg: Mapping[str, Any], server_round: int, pid: int
) -> Named:
    """Client ``pid``'s reply as it sends it: changed if it attacks (see the module's doc), else as it is."""
    run = common(cfg)
    kind = run.attack
    if kind in ("none", "label-flip") or pid not in attackers(cfg):
        return reply
    factor, sigma = run.attack_factor, run.attack_noise
    coords = (server_round,) if kind == "collude" else (server_round, pid)
    rng = seeds.rng("attack-collusion" if kind == "collude" else "attack-noise", run.seed, *coords)
    out = dict(reply)
    for name in poisoned_names(reply, sent, run.attack_arrays):
        w = reply[name].astype(np.float64)
        g = sent[name].astype(np.float64) if name in sent else np.zeros_like(w)
        if kind == "sign-flip":
            new = g - factor * (w - g)
        elif kind == "scale":
            new = g + factor * (w - g)
        else:  # noise, collude
            new = g + sigma * rng.standard_normal(g.shape)
        out[name] = new.astype(reply[name].dtype)
    return out


def poisoned_names(reply: Named, sent: Mapping[str, np.ndarray], arrays: str) -> list[str]:
    """The floating arrays of ``reply`` an attacker changes: those it was sent, then under ``all`` the others
    (in that order, so that a noise attack draws the same noise for the model in both)."""
    floating = {name for name, a in reply.items() if a.dtype.kind == "f"}
    own = sorted(floating & set(sent))
    return own + sorted(floating - set(sent)) if arrays == "all" else own
