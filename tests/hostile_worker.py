"""A SuperNode worker whose client replies are tampered with, for the real-deployment hostile-client test
(tests/test_deploy.py): every fit reply's float arrays come back as int64 and every evaluation reports an
accuracy of 5.0. Run as ``python tests/hostile_worker.py --address SOCKET``, like
``python -m fedbr_flwr.launch.worker``."""

import sys

from fedbr_flwr.app import node
from fedbr_flwr.launch import worker

honest_fit, honest_evaluate = node.FlowerClient.fit, node.FlowerClient.evaluate


def fit(self, parameters, config):
    arrays, n, metrics = honest_fit(self, parameters, config)
    return [a.astype("int64") if a.dtype.kind == "f" else a for a in arrays], n, metrics


def evaluate(self, parameters, config):
    loss, n, metrics = honest_evaluate(self, parameters, config)
    return loss, n, {**metrics, "accuracy": 5.0}


node.FlowerClient.fit, node.FlowerClient.evaluate = fit, evaluate

if __name__ == "__main__":
    sys.exit(worker.main())
