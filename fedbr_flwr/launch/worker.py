"""A SuperNode's long-lived client process (deployment).

Flower 1.41 runs every message in a new ClientApp process, so a client would import torch, build
its data on the device and its model again each round. ``fedbr-worker`` is started once beside a
SuperNode (``fedbr-deploy supernode`` does it) and serves that node's messages over a Unix socket:
the per-message ClientApp only forwards (run config, node config, Flower's ``context.state``, the
call) and writes back the new state. The worker keeps each run's client object (model and data on
the device, CUDA context) between rounds; ``context.state`` stays with Flower's SuperNode, so a
restarted worker loses nothing but its warm caches.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import traceback
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from ..app.client_app import key_path
from ..core.errors import describe
from ..runfiles.run_io import code_hash

log = logging.getLogger("fedbr-worker")
RUNS_KEPT = 2  # client objects (with their device memory) are kept for this many most recent runs


def write_private(path: Path, data: bytes) -> None:
    """A file only its owner may read, made so before the secret is written into it."""
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(data)


class Worker:
    """Holds one client object per (run, partition), built on first use and reused afterwards."""

    def __init__(self):
        from ..app.node import ClientCache

        self.clients = ClientCache(RUNS_KEPT)
        self.code = code_hash()

    def handle(self, request: dict) -> Any:
        if request.get("code") != self.code:  # it runs its installed code, not the run's app bundle
            raise RuntimeError(
                f"this worker runs code {self.code} but the run's app is {request.get('code')}: "
                "restart the worker (and its SuperNode) after installing the new version"
            )
        # the state is Flower's copy for this message; it is sent back after the call
        client = self.clients.get(request["run_id"], request["run_config"], request["node_config"], request["state"])
        return getattr(client, request["method"])(*request["args"])

    def serve(self, address: str) -> None:
        path = Path(address)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.unlink()
        key = secrets.token_bytes(32)
        write_private(key_path(address), key)
        with Listener(address, family="AF_UNIX", authkey=key) as listener:
            path.chmod(0o600)
            log.info("fedbr-worker %d ready on %s", os.getpid(), address)
            while True:
                try:
                    conn = listener.accept()
                except (OSError, EOFError) as exc:  # e.g. a client with the wrong key
                    log.warning("refused a connection: %s", exc)
                    continue
                with conn:
                    request = conn.recv()
                    try:
                        reply = ("ok", self.handle(request), request["state"])
                    except Exception as exc:  # the reply carries it to the ClientApp, which raises it
                        log.error("%s failed: %s", request.get("method"), traceback.format_exc())
                        reply = ("error", describe(exc), None)
                    conn.send(reply)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedbr-worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", required=True, help='Unix socket path (give the SuperNode worker="<path>")')
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        Worker().serve(args.address)
    except KeyboardInterrupt:
        pass
    finally:
        for p in (Path(args.address), key_path(args.address)):
            p.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
