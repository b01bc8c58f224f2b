"""Test doubles shared by test modules."""

from flwr.server.client_proxy import ClientProxy


class OfflineProxy(ClientProxy):
    """A client proxy whose messages all fail; tests override the ones they exercise."""

    def get_properties(self, ins, timeout, group_id):
        raise NotImplementedError

    def get_parameters(self, ins, timeout, group_id):
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError
