"""Flower's simulation looks for messages by polling (the engine every 0.1 s for the clients' instructions, the
in-memory grid every ``pull_interval`` for their replies); ``fedbr_flwr.app.flower_adapter`` makes both wake as soon as
a message is stored. Each wait here would take the whole (long) poll interval if the wake-up did not work."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest

from fedbr_flwr.app import flower_adapter

LONG = 60.0  # a poll interval no test could sit out: a wait that returns did so because it was woken


class FakeState:
    """The part of a LinkState the two loops use, in memory."""

    def __init__(self):
        self.ins: dict[int, list] = {}
        self.res: list = []

    def store_message_ins(self, message):
        self.ins.setdefault(message.dst, []).append(message)
        return message.id

    def get_message_ins(self, node_id, limit):
        taken, self.ins[node_id] = self.ins.get(node_id, [])[:limit], self.ins.get(node_id, [])[limit:]
        return taken

    def store_message_res(self, message):
        self.res.append(message)
        return message.id


def message(id_, dst=0, reply_to=""):
    return SimpleNamespace(id=id_, dst=dst, metadata=SimpleNamespace(reply_to_message_id=reply_to))


def test_a_stored_message_wakes_the_waiter_at_once_and_a_later_count_is_no_wake_up():
    state = FakeState()
    signal = flower_adapter.StoreSignal.on(state, "store_message_res")
    assert flower_adapter.StoreSignal.on(state, "store_message_res") is signal  # installed once per state
    seen = signal.seen()
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (signal.wait_after(seen, LONG), woke.set()))
    waiter.start()
    assert state.store_message_res(message("r1")) == "r1" and state.res[-1].id == "r1"  # still stores, returns
    assert woke.wait(10)
    waiter.join()
    signal.wait_after(signal.seen() - 1, LONG)  # a store already seen since: returns at once


def test_the_engine_takes_a_message_as_soon_as_the_server_stores_it(monkeypatch):
    from flwr.server.superlink.fleet.vce import vce_api

    monkeypatch.setattr(flower_adapter, "FLOWER_POLL_S", LONG)
    monkeypatch.setattr(vce_api, "add_messages_to_queue", vce_api.add_messages_to_queue)  # undone after the test
    flower_adapter.dispatch_messages_promptly()
    assert vce_api.add_messages_to_queue.prompt  # ours, whose poll interval is now a minute
    state, taken, stop = FakeState(), queue.Queue(), threading.Event()
    extractor = threading.Thread(target=vce_api.add_messages_to_queue, args=(state, taken, {0: 0, 1: 1}, stop))
    extractor.start()
    try:
        for k in range(3):  # one after another, each stored while the extractor waits
            state.store_message_ins(message(f"m{k}", dst=k % 2))
            assert taken.get(timeout=10).id == f"m{k}"
    finally:
        stop.set()
        state.store_message_ins(message("last"))  # wakes it to see the stop
        extractor.join(10)
    assert not extractor.is_alive()


class FakeGrid:
    def __init__(self, state):
        self.state = state

    def push_messages(self, messages):
        return [m.id for m in messages]

    def pull_messages(self, ids):
        ready = [m for m in self.state.res if m.metadata.reply_to_message_id in set(ids)]
        self.state.res = [m for m in self.state.res if m not in ready]
        return ready


def test_the_grid_returns_the_replies_as_soon_as_the_last_is_stored_and_keeps_its_timeout(monkeypatch):
    monkeypatch.setattr(flower_adapter, "FLOWER_POLL_S", LONG)
    state = FakeState()
    grid = FakeGrid(state)
    flower_adapter.receive_replies_promptly(grid)
    got = {}
    asking = threading.Thread(target=lambda: got.update(r=grid.send_and_receive([message("a"), message("b")])))
    asking.start()
    state.store_message_res(message("ra", reply_to="a"))
    state.store_message_res(message("rb", reply_to="b"))
    asking.join(10)
    assert not asking.is_alive() and sorted(m.id for m in got["r"]) == ["ra", "rb"]
    assert [m.id for m in grid.send_and_receive([message("c")], timeout=0.2)] == []  # none came: gives up


def test_a_grid_without_a_link_state_is_left_as_it_is():
    grid = SimpleNamespace(send_and_receive="Flower's own")
    flower_adapter.receive_replies_promptly(grid)
    assert grid.send_and_receive == "Flower's own"


@pytest.mark.parametrize("stop_first", [True, False])
def test_the_engines_extractor_still_ends_on_its_stop_event(monkeypatch, stop_first):
    from flwr.server.superlink.fleet.vce import vce_api

    monkeypatch.setattr(flower_adapter, "FLOWER_POLL_S", 0.05)
    monkeypatch.setattr(vce_api, "add_messages_to_queue", vce_api.add_messages_to_queue)
    flower_adapter.dispatch_messages_promptly()
    stop = threading.Event()
    if stop_first:
        stop.set()
    extractor = threading.Thread(target=vce_api.add_messages_to_queue, args=(FakeState(), queue.Queue(), {}, stop))
    extractor.start()
    stop.set()
    extractor.join(10)
    assert not extractor.is_alive()
