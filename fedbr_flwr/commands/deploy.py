"""``fedbr-deploy``: the same app on a real Flower deployment, a SuperLink and one SuperNode per client.

On separate machines (every command prints the Flower command it runs):

    fedbr-deploy certs deploy-keys --host 10.0.0.1 --supernodes 4        # once: CA, server cert, node keys
    fedbr-deploy superlink --certs deploy-keys --auth                     # on the server machine
    fedbr-deploy register --superlink 10.0.0.1:8000 --certs deploy-keys   # allow the node keys (--auth)
    fedbr-deploy supernode --superlink 10.0.0.1:8000 --certs deploy-keys \\
        --partition-id 0 --num-partitions 4 --data-dir /data --gpu 0 --auth-key deploy-keys/supernode-0
    fedbr-deploy run --superlink 10.0.0.1:8000 --certs deploy-keys experiments/fedavg_rotmnist5k.yaml \\
        num-clients=4 num-rounds=20

All of it on this machine (127.0.0.1), started, run and stopped in one command:

    fedbr-deploy local --supernodes 2 --tls --auth experiments/fedavg_rotmnist5k.yaml num-rounds=4

Each SuperNode is paired with a ``fedbr-worker`` (``fedbr_flwr/launch/worker.py``) that keeps the client's
data, model and CUDA context alive between rounds: Flower 1.41 starts a new ClientApp process for
every message in both isolation modes. ``--resume DIR`` continues a run from its checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from ..core.config import common
from ..core.errors import ConfigError, OneLineParser, quiet_when_its_reader_leaves
from ..launch import watchdog
from ..launch.launcher import (
    EXIT_LINE,
    RunFailed,
    flags,
    flower_env,
    flower_tool,
    free_port,
    how_to_continue,
    last_error,
    started_run_id,
    stop_cause,
    stop_tree,
    submit_run,
    wait_healthy,
)
from ..launch.worker import write_private
from ..runfiles import runlock
from ..runfiles.progress import mark_stopped, read_lines
from ..runfiles.run_io import check_output_dir, finish_run, only_end_left

CONNECTION = "fedbr"
NODE_START_TIMEOUT_S = 60
# how often a SuperNode's launcher looks for a message to run (Flower's default: 1 s, paid on every message)
TASK_POLL_INTERVAL_S = "0.05"
CA, SERVER_CERT, SERVER_KEY = "ca.crt", "server.pem", "server.key"


# ---------------------------------------------------------------- certificates and node keys


def make_certificates(out: Path, hosts: Sequence[str], supernodes: int, days: int = 365) -> list[Path]:
    """A self-signed CA, the SuperLink's certificate for ``hosts`` (IPs or names), and one EC key pair per
    SuperNode in OpenSSH format (Flower's SuperNode authentication). Returns the private key paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedbr-flwr CA")])

    def cert(subject: str, key, extension, critical: bool):
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(extension, critical=critical)
            .sign(ca_key, hashes.SHA256())
        )

    def alt_name(host: str):
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    ca_cert = cert("fedbr-flwr CA", ca_key, x509.BasicConstraints(ca=True, path_length=None), True)
    server_key = ec.generate_private_key(ec.SECP384R1())
    # a common name has at most 64 characters; clients match the alternative names, which hold every host
    server_cert = cert(hosts[0][:64], server_key, x509.SubjectAlternativeName([alt_name(h) for h in hosts]), False)
    pem = serialization.Encoding.PEM
    write_private(
        out / SERVER_KEY, server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (out / SERVER_CERT).write_bytes(server_cert.public_bytes(pem))
    (out / CA).write_bytes(ca_cert.public_bytes(pem))
    keys = []
    for i in range(supernodes):
        key = ec.generate_private_key(ec.SECP384R1())
        path = out / f"supernode-{i}"
        write_private(path, key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
        path.with_name(path.name + ".pub").write_bytes(
            key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        )
        keys.append(path)
    return keys


def check_certs(certs: Path, server: bool) -> None:
    needed = [CA] + ([SERVER_CERT, SERVER_KEY] if server else [])
    missing = [n for n in needed if not (certs / n).is_file()]
    if missing:
        raise ConfigError(f"{certs} lacks {', '.join(missing)}: make them with `fedbr-deploy certs {certs}`")


def certificate_problem(path: Path, now: datetime.datetime | None = None) -> str | None:
    """Why clients would refuse the certificate at ``path`` on dates alone (expired, or not valid yet)."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        return f"{path} cannot be read as a PEM certificate ({exc})"
    now = now or datetime.datetime.now(datetime.timezone.utc)
    remake = f"make new ones with `fedbr-deploy certs {path.parent}` and hand ca.crt to the SuperNodes again"
    if cert.not_valid_after_utc < now:
        return f"{path} expired on {cert.not_valid_after_utc:%Y-%m-%d}: SuperNodes will refuse it; {remake}"
    if cert.not_valid_before_utc > now:
        return f"{path} is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (check this machine's clock)"
    return None


# ---------------------------------------------------------------- Flower commands


def superlink_command(
    env: dict[str, str], host: str, port: int, certs: Path | None, auth: bool, state_dir: Path
) -> list[str]:
    tls = {"--ssl-ca-certfile": CA, "--ssl-certfile": SERVER_CERT, "--ssl-keyfile": SERVER_KEY}
    security = ["--insecure"] if certs is None else flags({k: str(certs / name) for k, name in tls.items()})
    if auth:
        if certs is None:
            raise ConfigError("SuperNode authentication needs TLS: give --certs (or --tls with local)")
        security.append("--enable-supernode-auth")
    options = flags({"--host": host, "--port": str(port), "--database": str(state_dir / "superlink.db")})
    return [flower_tool(env, "flower-superlink"), *security, *options, "--disable-runtime-dependency-installation"]


def node_config_string(values: dict[str, object]) -> str:
    """Flower's --node-config syntax: strings quoted, numbers bare."""
    return " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in values.items())


def supernode_command(
    env: dict[str, str], superlink: str, port: int, certs: Path | None, node_config: dict, auth_key: Path | None
) -> list[str]:
    security = ["--insecure"] if certs is None else ["--root-certificates", str(certs / CA)]
    if auth_key is not None:
        security += ["--auth-supernode-private-key", str(auth_key)]
    options = {"--superlink": superlink, "--port": str(port), "--node-config": node_config_string(node_config)}
    return [flower_tool(env, "flower-supernode"), *security, *flags(options)]


def worker_command(address: Path) -> list[str]:
    return [sys.executable, "-m", "fedbr_flwr.launch.worker", "--address", str(address)]


def write_connection(flwr_home: Path, address: str, certs: Path | None) -> None:
    """The ``fedbr`` connection in FLWR_HOME/config.toml, used by ``flwr run``, ``flwr ls`` and registration."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    security = "insecure = true" if certs is None else f'root-certificates = "{(certs / CA).resolve()}"'
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{address}"\n{security}\n'
    )


def register_supernodes(env: dict[str, str], public_keys: Sequence[Path]) -> list[Path]:
    """Allow each key on the SuperLink; the keys it had already (so that registering again, after adding
    keys, is harmless)."""
    known = []
    for key in public_keys:
        res = subprocess.run(
            [flower_tool(env, "flwr"), "supernode", "register", str(key), CONNECTION],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = (res.stdout + res.stderr).strip()
        if res.returncode != 0 and "already in use" in said.lower():  # Flower's words for a key it has
            known.append(key)
        elif res.returncode != 0:
            raise RunFailed(f"`flwr supernode register {key}` failed: {one_line(said)[-500:]}")
    return known


def one_line(said: str) -> str:
    """What a ``flwr`` command printed, in one line: without the frame of its boxes and the line breaks."""
    return " ".join(re.sub(r"[╭╮╰╯│─]", " ", said).split())


def process_env(flwr_home: Path) -> dict[str, str]:
    """The environment of deployment processes: ours, with Flower's quicker task polling."""
    env = flower_env(flwr_home)
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", TASK_POLL_INTERVAL_S)
    return env


def deploy_env(flwr_home: Path, address: str, certs: Path | None) -> dict[str, str]:
    env = process_env(flwr_home)
    write_connection(flwr_home, address, certs)
    return env


# ---------------------------------------------------------------- processes


@dataclass
class Deployment:
    """Processes started on this machine, by role; ``stop()`` ends them all with their children."""

    env: dict[str, str]
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        print(f"fedbr-deploy: {name}: {' '.join(command)}", flush=True)
        self.commands[name] = command
        log = open(self.log_dir / f"{name}.log", "ab")
        # killed with all it starts if fedbr-deploy dies, also by SIGKILL (see launch/watchdog.py)
        proc = watchdog.spawn(
            command, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        """Newest first, so that SuperNodes go before the SuperLink they talk to."""
        while self.procs:
            stop_tree(self.procs.pop(next(reversed(self.procs))))


def start_worker(deployment: Deployment, name: str, address: Path, gpu: str | None) -> None:
    env = dict(deployment.env)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    proc = deployment.start(name, worker_command(address), env)
    deadline = time.time() + NODE_START_TIMEOUT_S
    while not address.exists():
        if proc.poll() is not None or time.time() > deadline:
            raise RunFailed(f"{name} did not start; see {deployment.log_dir / (name + '.log')}")
        time.sleep(0.1)


@contextmanager
def local_deployment(
    out_dir: Path, num_supernodes: int, tls: bool = False, auth: bool = False, workers: bool = True
) -> Iterator[Deployment]:
    """A SuperLink and ``num_supernodes`` SuperNodes (partition i of n each, with a worker unless
    ``workers=False``) on 127.0.0.1, with TLS and SuperNode authentication when asked; stopped on exit,
    also on failure. Logs and keys go to ``out_dir/deploy``."""
    log_dir = out_dir / "deploy"
    log_dir.mkdir(parents=True, exist_ok=True)
    home = watchdog.temp_dir("fedbr-deploy-")  # removed also if this process is killed
    certs = None
    keys: list[Path] = []
    if tls or auth:
        certs = home / "certs"
        keys = make_certificates(certs, ["127.0.0.1", "localhost"], num_supernodes if auth else 0)
    port = free_port()
    address = f"127.0.0.1:{port}"
    deployment = Deployment(deploy_env(home / "flwr", address, certs), log_dir)
    try:
        superlink = deployment.start(
            "superlink", superlink_command(deployment.env, "127.0.0.1", port, certs, auth, home)
        )
        scheme = "https" if certs else "http"
        wait_healthy(
            superlink,
            f"{scheme}://127.0.0.1:{port}/health",
            log_dir / "superlink.log",
            verify=ssl.create_default_context(cafile=str(certs / CA)) if certs else True,
        )
        if auth:
            register_supernodes(deployment.env, [k.with_name(k.name + ".pub") for k in keys])
        for i in range(num_supernodes):
            node: dict[str, int | str] = {"partition-id": i, "num-partitions": num_supernodes}
            if workers:
                sock = home / f"worker-{i}.sock"
                start_worker(deployment, f"worker-{i}", sock, None)
                node["worker"] = str(sock)
            deployment.start(
                f"supernode-{i}",
                supernode_command(deployment.env, address, free_port(), certs, node, keys[i] if auth else None),
            )
        yield deployment
    finally:
        deployment.stop()
        watchdog.remove_temp_dir(home)


# ---------------------------------------------------------------- measurements


def round_seconds(out_dir: Path) -> dict[str, float]:
    """From a finished run's files: the median seconds of a round's fit phase (rounds after the first,
    which includes discovery) and the whole run's wall seconds per round."""
    import numpy as np

    from ..runfiles.metrics import read_jsonl

    rounds, evals = read_jsonl(out_dir / "rounds.jsonl"), read_jsonl(out_dir / "metrics.jsonl")
    fit = [r["seconds"] for r in rounds[1:]] or [r["seconds"] for r in rounds]
    return {
        "fit_s_per_round": float(np.median(fit)),
        "wall_s_per_round": float(evals[-1]["wall_time"]) / max(len(rounds), 1) if evals else float("nan"),
    }


# ---------------------------------------------------------------- command line


def _config(items: Sequence[str], resume: str | None, num_clients: int | None, files_here: bool = True) -> dict:
    """The run's config from files and overrides (``num_clients``: the local SuperNodes, which it must
    match), or from the checkpoint of the run being resumed. ``files_here=False``: the SuperLink is on another
    machine, so its run folder and data are not checked on this one."""
    from ..launch.plan import prepare, resume_config

    if resume:
        cfg = check_deployable(resume_config(Path(resume), items, "fedbr-deploy"))
        if num_clients is not None and common(cfg).num_clients not in (0, num_clients):
            raise ConfigError(
                f"the run in {resume} has num-clients = {common(cfg).num_clients}: resume it with --supernodes "
                f"{common(cfg).num_clients}"
            )
        return cfg
    return prepare(new_run_config(items, num_clients), overwrite=False, files_here=files_here)


def new_run_config(items: Sequence[str], num_clients: int | None) -> dict:
    """A new run's config, validated and not yet prepared (no folder, no data read): its num-clients set to
    ``num_clients`` (the local SuperNodes), which a num-clients it gives must equal."""
    from ..core.config import normalise_key, validate
    from ..launch.plan import settings_from

    settings = {normalise_key(k): v for k, v in settings_from(items).items()}
    cfg = validate(settings)
    if num_clients is not None:
        if common(cfg).num_clients not in (0, num_clients):
            raise ConfigError(
                f"num-clients = {common(cfg).num_clients} but --supernodes {num_clients}: drop "
                "num-clients or make them equal"
            )
        cfg = validate({**settings, "num-clients": num_clients})
    return check_deployable(cfg)


def check_deployable(cfg: dict) -> dict:
    """``cfg``, unless it asks for what only a simulation has."""
    run = common(cfg)
    if run.engine == "cohort":
        raise ConfigError(
            "engine=cohort runs in simulation only (fedbr-run): a deployment has one client per "
            "SuperNode; drop engine=cohort (engine=clients)"
        )
    if run.backend == "in-process":
        raise ConfigError(
            "backend = in-process runs simulated clients in one process (fedbr-run): a deployment's clients are "
            "its SuperNodes; drop backend"
        )
    return cfg


def _print_result(out: Path) -> int:
    """Print the run's summary; the exit code: 1 when the run trained no round (fedbr-run's rule)."""
    from .cli import print_result

    if not (out / "summary.md").exists():
        print(f"fedbr-deploy: the run's files are on the SuperLink's machine, in {out}")
        return 0
    return print_result(out, "fedbr-deploy")


def _check_supernodes(n: int) -> None:
    if n < 1:
        raise ConfigError(f"--supernodes {n}: a run needs at least one SuperNode (one client each)")


def cmd_local(args) -> int:
    _check_supernodes(args.supernodes)
    cfg = _config(args.items, args.resume, args.supernodes)
    run = common(cfg)
    out = Path(run.output_dir)
    if run.resume and only_end_left(out, run.num_rounds):  # no SuperNode needed
        finish_run(cfg, out)
        return _print_result(out)
    print(
        f"fedbr-deploy: {run.strategy} on {run.dataset}, {args.supernodes} SuperNodes on 127.0.0.1"
        f"{' with TLS' if args.tls or args.auth else ''}{' and SuperNode auth' if args.auth else ''} -> {out}",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every process it started is stopped
    try:
        with runlock.hold(out), local_deployment(out, args.supernodes, args.tls, args.auth, not args.no_worker) as dep:
            submit_run(cfg, dep.env, CONNECTION, out, echo="progress")
    except (KeyboardInterrupt, SystemExit) as exc:
        how, code = stop_of(exc)
        with contextlib.suppress(OSError):
            mark_stopped(out, stop_cause(exc))
        again = f"fedbr-deploy local --supernodes {args.supernodes} --resume {out}"
        print(
            f"fedbr-deploy: {how}; its processes stopped; {how_to_continue(out, again)}",
            file=sys.stderr,
        )
        return code
    return _print_result(out)


def stop_of(exc: BaseException) -> tuple[str, int]:
    """How Ctrl-C or SIGTERM (the handler's SystemExit(143)) stopped a command, and its exit code; any other
    SystemExit goes on."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(exc, SystemExit) and exc.code == 143:
        return "stopped by SIGTERM", 143
    raise exc


def cmd_run(args) -> int:
    certs = _certs_arg(args)
    cfg = _config(args.items, args.resume, None, files_here=on_this_machine(args.superlink))
    run = common(cfg)
    out = Path(run.output_dir)
    if run.resume and only_end_left(out, run.num_rounds):  # no SuperLink: --resume reads its folder on this machine
        finish_run(cfg, out)
        return _print_result(out)
    home = watchdog.temp_dir("fedbr-deploy-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the run on the SuperLink is stopped too
    try:
        env = deploy_env(home, args.superlink, certs)
        log = out / "flower.log"
        before = log.stat().st_size if log.is_file() else 0  # a resumed run's log holds the earlier pieces' too
        try:
            submit_run(cfg, env, CONNECTION, out, echo=args.echo)
        except (KeyboardInterrupt, SystemExit) as exc:
            how, code = stop_of(exc)
            again = f"`fedbr-deploy run --superlink {args.superlink} ... --resume {out}` on a machine that sees {out}"
            print(f"fedbr-deploy: {how}; {stop_remote_run(env, out, before)}; continue with {again}", file=sys.stderr)
            return code
    finally:
        watchdog.remove_temp_dir(home)
    return _print_result(out)


def on_this_machine(address: str) -> bool:
    """Whether a SuperLink ``address`` (host:port) names this machine: a loopback address or its own name."""
    host = address.rsplit(":", 1)[0].strip("[]").lower()
    return host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname().lower(), socket.getfqdn().lower())


def stop_remote_run(env: dict[str, str], out: Path, since: int = 0) -> str:
    """Stop the run this command submitted on the SuperLink (``flwr stop``), which would otherwise go on
    without anyone following it and hold its run folder; what became of it, in words. ``since``: where this
    submission's part of ``flower.log`` starts."""
    lines, _ = read_lines(out / "flower.log", since)
    run_id = next((i for i in map(started_run_id, lines) if i is not None), None)
    if run_id is None:
        return "no run had started on the SuperLink"
    try:
        res = subprocess.run(
            [flower_tool(env, "flwr"), "stop", str(run_id), CONNECTION],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        failed = (one_line(res.stdout + res.stderr) or "no output")[-200:] if res.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as exc:
        failed = str(exc)
    if failed:
        return f"run {run_id} may still run on the SuperLink: `flwr stop {run_id}` failed ({failed[:200]})"
    return f"run {run_id} was stopped on the SuperLink; its checkpoint and records are in {out} on the server machine"


def cmd_register(args) -> int:
    certs = _certs_arg(args)
    keys = [Path(k) for k in args.keys] or (sorted(certs.glob("supernode-*.pub")) if certs else [])
    if not keys:
        where = f"none in {certs}" if certs else "--insecure names no certificate folder to take them from"
        raise ConfigError(f"no public keys given and {where}")
    home = watchdog.temp_dir("fedbr-deploy-")
    try:
        known = register_supernodes(deploy_env(home, args.superlink, certs), keys)
    except RunFailed as exc:  # Flower's words do not say that TLS on one side only is the usual cause
        how = "without TLS (--insecure)" if certs is None else f"with TLS (the CA in {certs})"
        raise RunFailed(f"{exc} [connected {how}: the SuperLink must have been started the same way]") from exc
    finally:
        watchdog.remove_temp_dir(home)
    print(
        f"fedbr-deploy: registered {len(keys) - len(known)} SuperNode key(s)"
        + (f"; {len(known)} the SuperLink had already: {', '.join(k.name for k in known)}" if known else "")
    )
    return 0


def _certs_arg(args, server: bool = False) -> Path | None:
    if args.insecure:
        return None
    if not args.certs:
        raise ConfigError("give --certs DIR (from `fedbr-deploy certs`) or --insecure")
    certs = Path(args.certs).resolve()
    check_certs(certs, server)
    for name in [CA] + ([SERVER_CERT] if server else []):
        if problem := certificate_problem(certs / name):
            print(f"fedbr-deploy: warning: {problem}", file=sys.stderr, flush=True)
    return certs


# ---------------------------------------------------------------- a SuperNode that cannot connect

CONNECTION_FAILED = "Connection attempt failed"  # Flower's SuperNode log line, one per failed attempt
FAILURES_BEFORE_HINT = 3


def speaks_tls(address: str, timeout_s: float = 3.0) -> bool | None:
    """Whether the server at HOST:PORT completes a TLS handshake (its certificate is not checked): True,
    False (it answers, but not TLS), or None (nothing answers)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError):
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with context.wrap_socket(sock, server_hostname=host or None):
            return True
    except ssl.SSLError:
        return False
    except OSError:
        return None
    finally:
        sock.close()


def refused_certificate(address: str, ca: Path, timeout_s: float = 3.0) -> str | None:
    """Why a TLS handshake with the server at HOST:PORT fails when its certificate is checked against ``ca``
    (as Flower's SuperNode checks it), or None when it passes or nothing answers."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        context = ssl.create_default_context(cafile=str(ca))
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            with context.wrap_socket(sock, server_hostname=host):
                return None
    except ssl.SSLCertVerificationError as exc:
        return exc.verify_message or str(exc)
    except (OSError, ValueError, ssl.SSLError):
        return None


def tls_mismatch(superlink: str, tls: bool, ca: Path | None = None) -> str | None:
    """What to fix when this SuperNode's security does not match the SuperLink's, as far as a probe tells
    (with ``ca``: also whether the SuperLink's certificate passes the check against it)."""
    answer = speaks_tls(superlink)
    if answer is True and tls and ca is not None and (why := refused_certificate(superlink, ca)):
        return (
            f"the SuperLink at {superlink} presents a certificate that {ca} does not accept ({why}): give --certs "
            "the folder the SuperLink's certificates were made in, or make new ones with `fedbr-deploy certs DIR "
            "--host <the host SuperNodes connect to>`"
        )
    if answer is True and not tls:
        return (
            f"the SuperLink at {superlink} speaks TLS, but this SuperNode was started with --insecure: give "
            "--certs DIR (the folder from `fedbr-deploy certs` holding its ca.crt, passed to Flower as "
            "--root-certificates)"
        )
    if answer is False and tls:
        return (
            f"the SuperLink at {superlink} does not answer TLS (started with --insecure?): start both with "
            "--certs, or both with --insecure"
        )
    return None


class ConnectionWatch:
    """Reads on in a SuperNode's log; after FAILURES_BEFORE_HINT more failed connection attempts, says why it
    may fail to connect (a TLS mismatch, probed on the SuperLink's address, or where else to look), each
    message once. Called again and again: the SuperLink may start later, with other security."""

    def __init__(self, log_path: Path, superlink: str, tls: bool, ca: Path | None = None):
        self.log_path, self.superlink, self.tls, self.ca = log_path, superlink, tls, ca
        self.failures, self.shown = 0, set[str]()
        try:  # the log is appended to: lines of an earlier SuperNode in this state-dir do not count
            self.offset = log_path.stat().st_size
        except OSError:
            self.offset = 0

    def __call__(self) -> str | None:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.offset)
                new = f.read()
        except OSError:
            return None
        self.offset += len(new)
        self.failures += new.decode(errors="replace").count(CONNECTION_FAILED)
        if self.failures < FAILURES_BEFORE_HINT:
            return None
        self.failures = 0
        message = tls_mismatch(self.superlink, self.tls, self.ca) or (
            f"the SuperNode keeps failing to connect to the SuperLink at {self.superlink}: is it running, are the "
            "host and port right (--superlink HOST:PORT, the SuperLink's --port), does a firewall let it through?"
        )
        if message in self.shown:
            return None
        self.shown.add(message)
        return message


def _foreground(deployment: Deployment, hint=None) -> int:
    """Wait until any process ends or a signal arrives; then stop them all. ``hint()``, checked every few
    seconds: a warning to print, or None."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        next_hint = time.time() + 5
        while all(p.poll() is None for p in deployment.procs.values()):
            if hint is not None and time.time() > next_hint:
                message, next_hint = hint(), time.time() + 5
                if message:
                    print(f"fedbr-deploy: warning: {message}", file=sys.stderr, flush=True)
            time.sleep(0.5)
        ended = [k for k, p in deployment.procs.items() if p.poll() is not None]
        why = last_error(deployment.log_dir / f"{ended[0]}.log", EXIT_LINE)
        print(f"fedbr-deploy: {', '.join(ended)} exited{why}; see {deployment.log_dir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        deployment.stop()


def cmd_superlink(args) -> int:
    certs = _certs_arg(args, server=True)
    state = Path(args.state_dir).resolve()
    env = process_env(state / "flwr-home")
    command = superlink_command(env, args.host, args.port, certs, args.auth, state)  # checks before writing
    state.mkdir(parents=True, exist_ok=True)
    dep = Deployment(env, state)
    dep.start("superlink", command)
    return _foreground(dep)


def cmd_supernode(args) -> int:
    if args.num_partitions < 1 or not 0 <= args.partition_id < args.num_partitions:
        raise ConfigError(
            f"--partition-id {args.partition_id} --num-partitions {args.num_partitions}: need "
            "num-partitions >= 1 and 0 <= partition-id < num-partitions"
        )
    certs = _certs_arg(args)
    mismatch = tls_mismatch(args.superlink, certs is not None, certs / CA if certs else None)
    if mismatch and certs is None:  # plaintext to a TLS SuperLink never connects
        raise ConfigError(mismatch)
    if port_in_use(args.port):  # Flower's SuperNode says only that its runtime API failed to start
        raise ConfigError(
            f"--port {args.port} is in use on this machine (another SuperNode?): "
            "give each SuperNode here its own --port"
        )
    if mismatch:
        print(f"fedbr-deploy: warning: {mismatch}", file=sys.stderr, flush=True)
    state = Path(args.state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    dep = Deployment(process_env(state / "flwr-home"), state)
    node: dict[str, object] = {"partition-id": args.partition_id, "num-partitions": args.num_partitions}
    if args.data_dir:
        node["data-dir"] = str(Path(args.data_dir).resolve())
    name = f"supernode-{args.partition_id}"
    try:
        if not args.no_worker:
            sock = state / f"worker-{args.partition_id}.sock"
            start_worker(dep, f"worker-{args.partition_id}", sock, args.gpu)
            node["worker"] = str(sock)
        env = dict(dep.env)
        if args.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = args.gpu
        dep.start(
            name,
            supernode_command(
                env, args.superlink, args.port, certs, node, Path(args.auth_key).resolve() if args.auth_key else None
            ),
            env,
        )
    except BaseException:
        dep.stop()
        raise
    ca = certs / CA if certs else None
    return _foreground(dep, ConnectionWatch(state / f"{name}.log", args.superlink, certs is not None, ca))


def cmd_certs(args) -> int:
    if args.supernodes < 0:
        raise ConfigError(f"--supernodes {args.supernodes}: give the number of SuperNode key pairs to make (0 or more)")
    keys = make_certificates(Path(args.out), args.host or ["127.0.0.1", "localhost"], args.supernodes)
    print(
        f"fedbr-deploy: wrote {args.out}/{{{CA},{SERVER_CERT},{SERVER_KEY}}} and {len(keys)} SuperNode key pair(s) "
        f"(supernode-<i>, supernode-<i>.pub); keep the .key and private node keys secret"
    )
    return 0


def cmd_compare(args) -> int:
    """The same config in simulation and in a local deployment (with and without workers): s/round."""
    from .cli import main as fedbr_run

    _check_supernodes(args.supernodes)
    new_run_config(args.items, args.supernodes)  # before the simulation runs; a num-clients given must match
    base = Path(args.out).resolve()
    check_output_dir(base, "--out")  # else the first run's error named fedbr-run's output-dir
    rows = []
    runs = [("simulation", None), ("deployment + worker", True), ("deployment, no worker", False)]
    for label, workers in runs:
        out = base / label.replace(" ", "-").replace(",", "").replace("+", "with")
        items = [*args.items, f"output-dir={out}", f"num-clients={args.supernodes}"]
        if workers is None:
            code = fedbr_run([*items, "--overwrite", "--quiet"])
            if code:
                return code
        else:
            shutil.rmtree(out, ignore_errors=True)  # this comparison's own folder, from an earlier call
            cfg = _config(items, None, args.supernodes)
            with local_deployment(out, args.supernodes, workers=workers) as dep:
                submit_run(cfg, dep.env, CONNECTION, out, echo="none")
        rows.append((label, round_seconds(out)))
    print("\n| path | fit phase, s/round (median, rounds 2+) | wall s/round (whole run) |\n|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['fit_s_per_round']:.2f} | {r['wall_s_per_round']:.2f} |")
    return 0


NO_WORKER_HELP = "run each message in Flower's fresh ClientApp process"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fedbr-deploy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def security(p):
        p.add_argument("--certs", help="folder from `fedbr-deploy certs` (TLS)")
        p.add_argument("--insecure", action="store_true", help="no TLS (trusted networks and tests only)")

    p = sub.add_parser("certs", help="make a CA, the SuperLink's certificate and SuperNode keys")
    p.add_argument("out", help="the folder to write them into")
    p.add_argument("--host", action="append", help="the SuperLink's IP or name, as SuperNodes reach it (repeatable)")
    p.add_argument("--supernodes", type=int, default=0, help="SuperNode key pairs to make (for --auth)")
    p.set_defaults(func=cmd_certs)

    p = sub.add_parser("superlink", help="start a SuperLink (foreground)")
    security(p)
    p.add_argument(
        "--auth",
        action="store_true",
        help="accept only registered SuperNode keys (needs --certs); registering keys and submitting runs "
        "stay open to any machine that reaches the port and has ca.crt (docs/deployment.md: firewall it)",
    )
    p.add_argument("--host", default="0.0.0.0", help="the address it listens on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="the port SuperNodes and `run` connect to")
    p.add_argument("--state-dir", default="superlink-state", help="its database and logs")
    p.set_defaults(func=cmd_superlink)

    p = sub.add_parser("register", help="allow SuperNode public keys on a SuperLink started with --auth")
    security(p)
    p.add_argument("--superlink", required=True, help="HOST:PORT")
    p.add_argument("keys", nargs="*", help="public keys (default: every supernode-*.pub in --certs)")
    p.set_defaults(func=cmd_register)

    p = sub.add_parser("supernode", help="start a SuperNode and its worker (foreground)")
    security(p)
    p.add_argument("--superlink", required=True, help="HOST:PORT")
    p.add_argument("--partition-id", type=int, required=True, help="this node's client: its part of the split")
    p.add_argument("--num-partitions", type=int, required=True, help="clients of the run, one per SuperNode")
    p.add_argument("--data-dir", help="this machine's dataset folder (overrides the run's data-dir)")
    p.add_argument("--gpu", help="CUDA device index for this client (sets CUDA_VISIBLE_DEVICES)")
    p.add_argument("--auth-key", help="this node's private key (SuperLink started with --auth)")
    p.add_argument("--port", type=int, default=9094, help="the SuperNode's local runtime API port")
    p.add_argument("--no-worker", action="store_true", help=NO_WORKER_HELP)
    p.add_argument("--state-dir", default="supernode-state", help="its worker socket and logs")
    p.set_defaults(func=cmd_supernode)

    for name, func, text in (
        ("run", cmd_run, "submit a run to a deployment and follow it"),
        ("local", cmd_local, "SuperLink + SuperNodes on 127.0.0.1, run, stop them all"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("items", nargs="*", help="experiment YAML files and key=value overrides")
        p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint")
        if name == "run":
            security(p)
            p.add_argument("--superlink", required=True, help="HOST:PORT")
            p.add_argument(
                "--echo",
                choices=("all", "progress", "none"),
                default="all",
                help="what to print while the run goes on: Flower's whole log (all: the only channel "
                "from a SuperLink on another machine), the run's events from output-dir/progress.jsonl "
                "(progress: when this machine sees the run folder), or nothing",
            )
        else:
            p.add_argument("--supernodes", type=int, default=2, help="SuperNodes to start, one client each")
            p.add_argument("--tls", action="store_true", help="TLS between them, with certificates made for the run")
            p.add_argument("--auth", action="store_true", help="SuperNode authentication (implies --tls)")
            p.add_argument("--no-worker", action="store_true", help=NO_WORKER_HELP)
        p.set_defaults(func=func)

    p = sub.add_parser("compare", help="seconds per round: simulation vs local deployment, same config")
    p.add_argument("items", nargs="*", help="experiment YAML files and key=value overrides")
    p.add_argument("--supernodes", type=int, default=2, help="clients, one SuperNode each in the deployments")
    p.add_argument("--out", default="runs/deploy-compare", help="folder of the three runs")
    p.set_defaults(func=cmd_compare)
    return parser


def check_arguments(args: argparse.Namespace) -> None:
    """Addresses, ports, device indices and the certificate folder, checked before any process starts: a bad
    one made the SuperLink or SuperNode exit, or retry for ever, with only its log saying why."""
    if getattr(args, "superlink", None) is not None:
        host, colon, port = args.superlink.rpartition(":")
        if not (
            colon and is_host(host.removeprefix("[").removesuffix("]")) and port.isdigit() and 1 <= int(port) <= 65535
        ):
            raise ConfigError(
                f"--superlink {args.superlink!r}: give the SuperLink as HOST:PORT (no http://), e.g. 10.0.0.1:8000"
            )
    if getattr(args, "port", None) is not None and not 1 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: give a TCP port, 1 to 65535")
    gpu = getattr(args, "gpu", None)
    if gpu is not None and not all(index.isdigit() for index in gpu.split(",")):
        raise ConfigError(f"--gpu {gpu!r}: give a CUDA device index (0, 1, ...) or several, comma-separated")
    if getattr(args, "certs", None) and getattr(args, "insecure", False):
        raise ConfigError("give --certs DIR (TLS) or --insecure (no TLS), not both")
    if getattr(args, "state_dir", None) is not None:
        check_output_dir(Path(args.state_dir), "--state-dir")
    if args.command == "superlink" and not is_host(args.host):
        raise ConfigError(f"--host {args.host!r}: give the address to listen on (an IP address or a name)")
    auth_key = getattr(args, "auth_key", None)
    if auth_key:
        check_key_file(Path(auth_key), "--auth-key", private=True)
        if args.insecure:
            raise ConfigError("--auth-key: SuperNode authentication needs TLS: give --certs DIR, not --insecure")
    for key in getattr(args, "keys", None) or []:
        check_key_file(Path(key), "public key", private=False)
    if args.command == "certs":
        check_output_dir(Path(args.out), "certs folder")
        if (Path(args.out) / CA).exists():
            raise ConfigError(
                f"{args.out} already holds a CA ({CA}); the SuperNodes that trust it would be locked out by a new "
                "one: pick another folder, or remove this one to start over"
            )
        for host in args.host or []:
            if not is_host(host):
                raise ConfigError(f"--host {host!r}: give the SuperLink's IP address or DNS name, without a port")


def port_in_use(port: int) -> bool:
    """Whether a server listens on ``port`` of 127.0.0.1, where a SuperNode serves its local runtime API."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as its server: a closed connection does not count
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def check_key_file(path: Path, what: str, private: bool) -> None:
    """ConfigError unless ``path`` is a file holding an OpenSSH private key (``private``) or public key, as
    `fedbr-deploy certs` writes them (supernode-N and supernode-N.pub): Flower's own error says neither."""
    if not path.is_file():
        raise ConfigError(f"{what} {path}: no such file (fedbr-deploy certs --supernodes N makes the keys)")
    with open(path, "rb") as f:
        start = f.read(100)
    if private and b"PRIVATE KEY-----" not in start:
        raise ConfigError(f"{what} {path}: not a private key (give supernode-N, not supernode-N.pub)")
    if not private and not start.startswith((b"ecdsa-", b"ssh-")):
        raise ConfigError(f"{what} {path}: not an OpenSSH public key (give supernode-N.pub, not supernode-N)")


def is_host(text: str) -> bool:
    """An IP address, or a DNS name: dot-separated labels of letters, digits and inner hyphens, 1-63 characters
    each, 253 in all."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        labels = text.removesuffix(".").split(".")
        return len(text) <= 253 and all(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", p) for p in labels)


@quiet_when_its_reader_leaves
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_arguments(args)
        return args.func(args)
    except ConfigError as exc:
        print(f"fedbr-deploy: error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"fedbr-deploy: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fedbr-deploy: interrupted; every process it started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
