"""The server side every strategy shares, Flower-free, one job per module:

* ``updates``: client updates by name, their validation (fault filtering) and the weighted mean;
* ``robust``: the aggregation rules (mean, median, trimmed-mean, krum, multi-krum, norm-bound) and the
  round's plan every mean of a strategy goes through;
* ``recording``: the lines a round and an evaluation write to rounds.jsonl and metrics.jsonl;
* ``components``: the server part of a component (FedCM's global direction).

An algorithm's strategy (``strategies/<name>.py``) subclasses ``strategies.base.FederatedStrategy`` and
overrides its hooks, which receive and return plain Python: partition ids, named arrays, metric dicts. The
Flower strategy that drives them, with its routing, federation and checkpointing, is in ``fedbr_flwr.app``.
"""
