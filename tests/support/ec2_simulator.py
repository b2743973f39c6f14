"""Boot moto's EC2 instances as local processes, so the EC2 path runs end to end offline.

For every instance moto reports as pending/running, the simulator runs that
instance's *real* user-data (decoded from ``describe_instance_attribute``) as a local
process, with what a VM would give it:

- its own fake IMDSv2 server on 127.0.0.1 (token PUT, then instance-id,
  ami-launch-index, local-ipv4), found through ``AWS_EC2_METADATA_SERVICE_ENDPOINT``;
- an instance launched with an instance profile: that profile's role's temporary keys (STS) from its
  IMDS only, and no keys in its environment; a profile the simulator cannot resolve (unknown, or with no
  role) is an error in :attr:`EC2Simulator.profile_errors` and the node's console, and the node has no keys
  at all (IMDS answers 404 for credentials, as on EC2). An instance launched without a profile gets the
  moto server's credentials in its environment (an image with keys of its own);
- its own address: the private IP moto gave it when that is a loopback address (the
  test network's subnets are in 127.0.0.0/8, all of which is local on Linux), so the
  address the driver reads from DescribeInstances is the one the node really listens
  on; otherwise a fresh loopback address (the driver could not reach that node).
  ``address_of`` records (moto's private IP, the address the node uses). Loopback
  addresses were chosen over network namespaces with veth pairs because the moto
  server listens on 127.0.0.1 only, which other network namespaces cannot reach;
- where the kernel allows (root, util-linux unshare), its own PID namespace with its
  own /proc, so "power off" (SIGKILL to the namespace's init) takes every process of
  the node with it, as terminating a VM does.

When moto says an instance is shutting down or terminated, the simulator kills that
node's processes. ``boot`` decides per instance whether it boots at all (a node that
never comes up).

Two images. By default (``bare=False``) a node runs with the driver's venv on ``PATH`` and this
checkout on ``PYTHONPATH`` (an image with everything baked in: ``environment="image"``). With
``bare=True`` a node gets a *bare image*: a venv of the system Python holding only pip
(:func:`bare_image`), no uv, no checkout on any path; the environment stage in the user-data
fetches its pinned uv wheel from a package index on 127.0.0.1 (:mod:`support.wheel_index`) and builds the
driver's environment from the store, installing packages offline from uv's cache (``./dev`` fills
it), under ``env_root`` (one folder for the simulator's nodes: a second node, or a second boot,
with the same environment reuses the venv the first one built).

cloud-init's world (``cloud_init``, the default for a bare image where PID namespaces are available):
the user-data runs as cloud-init runs it, with cwd ``/``, no HOME, LANG or USER and PATH
``/usr/sbin:/usr/bin:/sbin:/bin`` (behind the node's own ``shutdown`` and the image's ``python3``,
which stand for the image's programs there), in a mount namespace where root's home (its
/etc/passwd entry) is the node's own folder ``root`` and ``/var/lib`` an overlay writing into the
node's ``var-lib``: cloud-init's per-boot scripts (``/var/lib/cloud/scripts/per-boot``) are seen
there, and nothing is written to this machine's ``/root`` or ``/var``.
Sources: https://github.com/openfaas/faasd/issues/282 (HOME unset under cloud-init); cloud-init docs,
"Module reference: Scripts per boot" and "Scripts user" (user-data once per instance, per-boot
scripts at every boot). :meth:`EC2Simulator.reboot` kills the node's processes and runs the per-boot
scripts, not the user-data; ``shutdown -h +N`` is recorded as scheduled (shutdown(8): systemd holds
it and returns), lost at a reboot, and :meth:`EC2Simulator.end_lifetime` makes it due.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import logging
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from support.aws_fixtures import network_octet
from support.processes import remove_machine_cgroups

REPO_ROOT = Path(__file__).resolve().parents[2]
_LOG = logging.getLogger(__name__)
DEAD_STATES = ("shutting-down", "terminated", "stopping", "stopped")
#: the states whose instances a tick describes: the ones that boot, or run on
LIVE_STATES = ("pending", "running")


class FakeIMDS:
    """A tiny IMDSv2: tokens are required, as on a real instance with IMDSv2 enforced.

    ``credentials_late_s``: for that many seconds after the node first asks it anything (a simulated
    machine's boot is its user-data starting: a loaded test machine may take seconds to get there),
    ``iam/security-credentials/`` and
    everything under it answer 404, as on EC2 while an instance profile propagates (seconds to about
    two minutes after launch: hashicorp/terraform-provider-aws issue "IAM instance profile not
    propagated" threads, hashicorp/packer "Instance profile ... not yet available"). Seconds are
    counted on ``clock_scale`` (real seconds times the scale): the node's retry helper runs on the
    same scale (:mod:`support.node_clock`), so 90 s of lateness pass in 90/scale real seconds; or on
    ``clock`` (a test's virtual clock's ``monotonic``) when given.

    ``credentials_answer_s``: every answer under ``iam/security-credentials/`` comes that many (real)
    seconds late, as on an instance whose CPUs a job keeps busy. botocore's defaults (a 1 s timeout, one
    attempt) then find no credentials: ``NoCredentialsError`` at a client's first call, for good
    (boto/botocore#1791, #2117, #2304; aws/aws-sdk-php#2022: "timed out after 1000 milliseconds")."""

    def __init__(self, metadata: dict[str, str], credentials_late_s: float = 0.0, clock_scale: float = 1.0,
                 clock: Callable[[], float] | None = None, credentials_answer_s: float = 0.0) -> None:
        self.metadata = metadata
        self.credentials_answer_s = credentials_answer_s
        self.token = base64.urlsafe_b64encode(os.urandom(18)).decode()
        self.credentials_late_s = credentials_late_s
        self.clock_scale = clock_scale
        self.clock = clock or (lambda: time.monotonic() * clock_scale)
        self.started: float | None = None
        #: how many credential requests were answered 404 because the profile had not propagated
        self.late_answers = 0
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
                imds.booted()
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                if self.path == "/latest/api/token" and ttl:
                    self._send(200, imds.token)
                else:
                    self._send(400, "bad token request")

            def do_GET(self) -> None:  # noqa: N802
                imds.booted()
                if self.headers.get("X-aws-ec2-metadata-token") != imds.token:
                    self._send(401, "")
                    return
                prefix = "/latest/meta-data/"
                key = self.path[len(prefix):] if self.path.startswith(prefix) else None
                credentials = key is not None and key.startswith("iam/security-credentials/")
                if credentials and imds.credentials_answer_s:
                    time.sleep(imds.credentials_answer_s)
                if credentials and imds.credentials_late():
                    imds.late_answers += 1
                    self._send(404, "")
                elif key in imds.metadata:
                    self._send(200, imds.metadata[key])
                else:
                    self._send(404, "")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def credentials_late(self) -> bool:
        return self.clock() - self.booted() < self.credentials_late_s

    def booted(self) -> float:
        """When the node first asked (on ``clock``)."""
        if self.started is None:
            self.started = self.clock()
        return self.started

    @staticmethod
    def role_entries(role: str, keys: tuple[str, str, str], expires_in_s: float) -> dict[str, str]:
        """IMDS entries of an instance profile's role whose keys expire in ``expires_in_s`` (wall-clock)
        seconds, in EC2's document format; replace them in ``metadata`` to rotate the credentials."""
        import datetime as _dt

        now = _dt.datetime.now(_dt.timezone.utc)
        document = {"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": keys[0], "SecretAccessKey": keys[1],
                    "Token": keys[2], "LastUpdated": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "Expiration": (now + _dt.timedelta(seconds=expires_in_s)).strftime("%Y-%m-%dT%H:%M:%SZ")}
        return {"iam/security-credentials/": role, f"iam/security-credentials/{role}": json.dumps(document)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


#: a folder whose ``sitecustomize`` runs a node's retry helper on a scaled clock (``SGPU_TEST_CLOCK_SCALE``)
NODE_CLOCK = Path(__file__).resolve().parent / "node_clock"
#: a folder whose ``sitecustomize`` keeps the bytecode of the files uv hard-linked into a node's venv in
#: one folder for the machine (``SGPU_TEST_NODE_PYCACHE``): a new venv does not compile them again
NODE_PYCACHE = Path(__file__).resolve().parent / "node_pycache"


def shared_pycache() -> Path:
    """The machine's folder of simulated nodes' shared bytecode (:data:`NODE_PYCACHE`)."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"sgpu-node-pycache-{os.getuid()}"


@dataclass
class SimulatedNode:
    instance_id: str
    launch_index: int
    moto_ip: str
    address: str
    imds: FakeIMDS
    proc: subprocess.Popen[bytes]
    log: Path
    user_data: str
    killed: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def bare_image(python: str | Path | None = None) -> Path:
    """A venv of the system Python (or of ``python``) with only pip in it: what a bare machine
    image brings (no uv: the environment stage fetches its own). Made once per machine and Python (by whichever test process comes first, under a
    lock) in the temporary folder."""
    import fcntl
    import tempfile

    base = Path(python or getattr(sys, "_base_executable", sys.executable)).resolve()
    version = subprocess.run([str(base), "-c", "import sys; print('%d%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    tag = f"{version}-{os.getuid()}"
    image = Path(tempfile.gettempdir()) / f"sgpu-bare-python-{tag}"
    ready = image / ".ready"
    if ready.exists():
        return image
    with open(Path(tempfile.gettempdir()) / f".sgpu-bare-python-{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            shutil.rmtree(image, ignore_errors=True)
            subprocess.run([str(base), "-m", "venv", str(image)], check=True, capture_output=True)
            ready.touch()
    return image


def pid_namespaces() -> bool:
    """Can a simulated machine get a PID namespace of its own (root, util-linux unshare)?"""
    unshare = shutil.which("unshare")
    if not unshare or os.geteuid() != 0:
        return False
    probe = [unshare, "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc", "--", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def in_process_moto_states() -> frozenset[tuple[str, str]] | None:
    """(instance id, state) of every instance this process's moto backends hold, every account and
    region; None where they could not be read (another thread changed them mid-read).

    The simulator's cheap question between two DescribeInstances: a tick through the fault proxy costs
    about 15 ms of CPU (botocore, the proxy and moto's XML, measured on 2 instances), this read about
    0.1 ms. Only meaningful where the moto server runs in this process (the tests' ThreadedMotoServer)."""
    try:
        from moto.ec2.models import ec2_backends

        seen = []
        for account in list(dict.values(ec2_backends)):
            for backend in list(dict.values(account)):
                for reservation in list(backend.reservations.values()):
                    seen += [(inst.id, inst._state.name) for inst in list(reservation.instances)]
        return frozenset(seen)
    except (RuntimeError, AttributeError, ImportError):
        return None


class EC2Simulator:
    """Watch moto's instances; boot each one's user-data as a node, kill it when terminated."""

    def __init__(
        self,
        ec2_client: Any,
        aws_env: dict[str, str],
        workdir: Path,
        boot: Callable[[dict[str, Any]], bool] | None = None,
        interval: float = 0.3,
        bare: bool = False,
        env_root: Path | None = None,
        cloud_init: bool | None = None,
        moto_in_process: bool = False,
    ) -> None:
        self.ec2 = ec2_client
        self.aws_env = aws_env
        self.workdir = Path(workdir)
        self.boot = boot or (lambda _inst: True)
        self.interval = interval
        self.bare = bare
        self.env_root = Path(env_root) if env_root else self.workdir / "envs"
        self.nodes: dict[str, SimulatedNode] = {}
        self.skipped: set[str] = set()
        self.namespaces = pid_namespaces()
        #: run user-data in cloud-init's environment (module docstring); needs PID (and mount) namespaces
        self.cloud_init = (bare and self.namespaces) if cloud_init is None else cloud_init
        if self.cloud_init and not self.namespaces:
            raise ValueError("cloud_init=True needs PID and mount namespaces (root and util-linux unshare): "
                             "without them /root and /var/lib would be this machine's own")
        base = network_octet()  # this worker's own addresses (see aws_fixtures.network_octet)
        self._addresses = (f"127.{base}.{n // 250}.{n % 250 + 1}" for n in itertools.count())
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        #: variables of every node booted from now on (None: unset), as an image's own settings would be
        self.env_overrides: dict[str, str | None] = {}
        #: more variables of one instance (given moto's description of it), as that one image's settings
        self.image_env: Callable[[dict[str, Any]], dict[str, str | None]] = lambda _inst: {}
        #: seconds from an instance's first sight until its user-data runs (a real GPU instance's boot)
        self.boot_delay_s = 0.0
        #: seconds (on ``clock_scale``) after boot during which IMDS serves no instance-profile credentials
        self.credentials_late_s = 0.0
        #: real seconds every IMDS answer of instance-profile credentials takes (a busy machine's)
        self.credentials_answer_s = 0.0
        #: how much faster than real time the nodes' retry helper and their IMDS count (1: real time)
        self.clock_scale = 1.0
        #: nodes share the bytecode of the files uv hard-linked into their venvs (:data:`NODE_PYCACHE`);
        #: False: each venv compiles its own, as a fresh machine does
        self.shared_pycache = True
        #: instance types whose nodes have NVMe instance store, mounted where the Deep Learning AMIs mount it
        #: (/opt/dlami/nvme on g5, g6, p4d, p5; AWS Deep Learning AMI release notes, "AWS Deep Learning Base
        #: GPU AMI"): a folder of the node's own stands in for it, named by PREFECT_SGPU_FAST_DISK (this
        #: machine's /opt is not the node's), and the image names no environments' root. None by default.
        self.instance_store_types: set[str] = set()
        self._seen: dict[str, float] = {}
        #: the AWS endpoint of the simulator's own IAM and STS reads (an instance's profile, its role's keys):
        #: EC2's control plane, not a request of any caller, so a fault proxy's rules, records and IAM model
        #: do not apply to them (conformance_ec2 sets moto's own URL). None: the ec2 client's endpoint
        self.control_plane_url: str | None = None
        #: seconds the simulator waits for an instance's profile to become readable (IAM propagation) before
        #: the node boots without keys; counted on ``prefect_sgpu.retry.CLOCK`` (a test's virtual clock)
        self.profile_wait_s = 10.0
        #: instance id -> why its instance profile gave it no keys (the node booted with none)
        self.profile_errors: dict[str, str] = {}
        self._control: dict[str, Any] = {}
        #: the moto server runs in this process: a tick describes instances (through the proxy, as a caller
        #: would) only when moto's instances or their states changed since the last description, when an
        #: instance waits out ``boot_delay_s``, and at least every ``describe_every_s``
        self.moto_in_process = moto_in_process
        self.describe_every_s = 5.0
        self._described: tuple[float, frozenset[tuple[str, str]] | None] = (-1e9, None)
        self._awaiting_boot = False

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> "EC2Simulator":
        self._thread = threading.Thread(target=self._loop, name="ec2-simulator", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for node in self.nodes.values():
                self._power_off(node)
                node.imds.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - keep simulating; tests read .errors
                self.errors.append(f"{type(exc).__name__}: {exc}")

    # -- one pass -----------------------------------------------------------------

    def _unchanged(self, states: frozenset[tuple[str, str]] | None) -> bool:
        """Nothing a description would show has changed since the last one (see ``moto_in_process``)."""
        if states is None or self._awaiting_boot:
            return False
        at, described = self._described
        return described == states and time.monotonic() - at < self.describe_every_s

    def tick(self) -> None:
        with self._lock:
            states = in_process_moto_states() if self.moto_in_process else None  # read once a tick
            if self._unchanged(states):
                return
            found = self._instances()
            if states is not None and not {i["InstanceId"] for i in found} <= {iid for iid, _ in states}:
                # moto answered with instances this process does not hold: it is not this process's moto
                self.moto_in_process, states = False, None
            self._described = (time.monotonic(), states)
            self._awaiting_boot = False
            for inst in found + self._gone(found):
                iid, state = inst["InstanceId"], inst["State"]["Name"]
                node = self.nodes.get(iid)
                if state in DEAD_STATES:
                    if node is not None and not node.killed:
                        self._power_off(node)
                elif node is None and iid not in self.skipped:
                    now = time.monotonic()  # one reading: at first sight the instance has waited 0 s, not less
                    if now - self._seen.setdefault(iid, now) < self.boot_delay_s:
                        self._awaiting_boot = True
                        continue
                    if self.boot(inst):
                        self.nodes[iid] = self._boot(inst)
                    else:
                        self.skipped.add(iid)

    def _instances(self) -> list[dict[str, Any]]:
        """Moto's pending and running instances.

        Only those: moto keeps terminated instances for the whole session (EC2 drops them after
        about an hour), and the shared moto server of a test worker holds every instance of every
        test before. Describing all of them at every tick made each tick's cost grow with the
        session (measured on moto 5: 23 ms of CPU with 2 instances, 153 ms with 40, 427 ms with
        120, when a tick comes every 0.3 s)."""
        live = [{"Name": "instance-state-name", "Values": list(LIVE_STATES)}]
        found = []
        for page in self.ec2.get_paginator("describe_instances").paginate(Filters=live):
            for reservation in page.get("Reservations", []):
                found += reservation.get("Instances", [])
        return found

    def _gone(self, live: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Booted nodes still up whose instance is no longer pending or running. EC2's other states
        (shutting-down, terminated, stopping, stopped) are all ones in which the VM no longer runs, as is
        an id EC2 no longer knows: each such node is powered off as a terminated one is."""
        seen = {inst["InstanceId"] for inst in live}
        return [{"InstanceId": iid, "State": {"Name": "terminated"}}
                for iid, node in self.nodes.items() if not node.killed and iid not in seen]

    def _identity(self, inst: dict[str, Any]) -> tuple[str, str, str, FakeIMDS, dict[str, str]]:
        """What an instance boots with: its user-data, moto's and its own address, its IMDSv2 (with
        its instance profile's credentials) and those credentials."""
        iid = inst["InstanceId"]
        raw = self.ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")
        user_data = base64.b64decode(raw["UserData"].get("Value", "")).decode()
        moto_ip = inst.get("PrivateIpAddress", "")
        address = moto_ip if moto_ip.startswith("127.") else next(self._addresses)
        role_credentials = self._role_credentials(inst)
        imds = FakeIMDS({
            "instance-id": iid,
            "ami-launch-index": str(inst.get("AmiLaunchIndex", 0)),
            "local-ipv4": address,
            "instance-type": inst.get("InstanceType", ""),
            "placement/availability-zone": inst.get("Placement", {}).get("AvailabilityZone", ""),
            **role_credentials,
        }, credentials_late_s=self.credentials_late_s, clock_scale=self.clock_scale,
            credentials_answer_s=self.credentials_answer_s)
        return user_data, moto_ip, address, imds, role_credentials

    def _boot(self, inst: dict[str, Any]) -> SimulatedNode:
        iid = inst["InstanceId"]
        user_data, moto_ip, address, imds, role_credentials = self._identity(inst)
        home = self.workdir / iid
        (home / "home").mkdir(parents=True, exist_ok=True)
        if iid in self.profile_errors:  # loud on the node's console too, before anything of the node runs
            with open(home / "console.log", "a") as console:
                console.write(f"ec2-simulator: ERROR: {self.profile_errors[iid]}\n")
        self._install_shutdown(home, iid)
        script = home / "user-data"
        script.write_text(user_data)
        script.chmod(0o755)
        env = {
            "PATH": f"{home / 'bin'}:{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "PYTHONPATH": str(REPO_ROOT),  # the AMI's installed prefect-sgpu
            **(self._bare_env(home) if self.bare else {}),
            "HOME": str(home / "home"),
            "LANG": "C.UTF-8",
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.url,
            "PREFECT_SGPU_NODE_DIR": str(home / "jobs"),
            "PREFECT_SGPU_HOME": str(home / "sgpu-home"),
            # no GPU on a simulated VM: CPU ranks with gloo
            "SGPU_DEVICE": "cpu", "PREFECT_SGPU_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            **self.aws_env,
        }
        if self.bare:
            env.pop("PYTHONPATH")
        if self.clock_scale != 1.0:  # the node's retry helper waits on the scale its IMDS counts on
            env["SGPU_TEST_CLOCK_SCALE"] = str(self.clock_scale)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(NODE_CLOCK), env.get("PYTHONPATH")) if p)
        if self.shared_pycache:  # first: only one sitecustomize runs (this one runs node_clock's too)
            env["SGPU_TEST_NODE_PYCACHE"] = str(shared_pycache())
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(NODE_PYCACHE), env.get("PYTHONPATH")) if p)
        for name, value in {**self.env_overrides, **self.image_env(inst)}.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        if inst.get("InstanceType") in self.instance_store_types:
            (home / "opt-dlami-nvme").mkdir(exist_ok=True)
            env["PREFECT_SGPU_FAST_DISK"] = str(home / "opt-dlami-nvme")
            env.pop("PREFECT_SGPU_ENV_ROOT", None)
        if self._profile_name(inst):  # the instance profile's role, from IMDS only, as on EC2 (or no keys at all)
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
                env.pop(name, None)
        if os.environ.get("TORCH_EXTENSIONS_DIR"):
            env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
        if self.cloud_init:
            env = self._cloud_init_env(env, home)
        else:  # the per-boot scripts in the node's folder: this machine's /var/lib is not the node's
            env["PREFECT_SGPU_PER_BOOT_DIR"] = str(home / "per-boot")
        log = home / "console.log"
        proc = self._run_on_node(home, env, f"exec bash {script}")
        node = SimulatedNode(iid, int(inst.get("AmiLaunchIndex", 0)), inst.get("PrivateIpAddress", ""),
                             address, imds, proc, log, user_data)
        node.info["env"] = env
        return node

    def _cloud_init_env(self, env: dict[str, str], home: Path) -> dict[str, str]:
        """``env`` as cloud-init leaves it: no HOME, LANG, LC_*, USER or LOGNAME, a minimal PATH (the
        node's ``shutdown`` and the image's ``python3`` in front stand for the image's own in /usr/sbin
        and /usr/bin). What remains are the simulator's stand-ins (IMDS endpoint, node folders)."""
        image = bare_image()
        dropped = ("HOME", "LANG", "LANGUAGE", "USER", "LOGNAME")
        env = {k: v for k, v in env.items() if k not in dropped and not k.startswith("LC_")}
        env["PATH"] = f"{home / 'bin'}:{image / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin"
        return env

    def _run_on_node(self, home: Path, env: dict[str, str], command: str) -> subprocess.Popen[bytes]:
        """``command`` (bash) as the node's process tree: in a PID namespace where there are; in cloud-init's
        world with cwd ``/``, root's home (in /etc/passwd) the node's folder ``root`` and ``/var/lib`` an overlay
        whose writes land in the node's ``var-lib``: this machine's files stay readable, none is changed (root's
        home is moved rather than overlaid: uv's hard links from its cache into the node's venvs keep working)."""
        argv = ["bash", "-c", command]
        cwd = home
        if self.cloud_init:
            upper, work, root = home / "var-lib", home / ".var-lib-work", home / "root"
            for folder in (upper, work, root):
                folder.mkdir(exist_ok=True)
            passwd = home / "passwd"
            passwd.write_text("".join(
                ":".join([*f[:5], str(root), *f[6:]]) + "\n" if f[0] == "root" else ":".join(f) + "\n"
                for f in (line.split(":") for line in Path("/etc/passwd").read_text().splitlines() if line)))
            mounts = (f"mount -t overlay overlay -o lowerdir=/var/lib,upperdir={upper},workdir={work} /var/lib && "
                      f"mount --bind {passwd} /etc/passwd && cd / && ")
            argv = ["/bin/bash", "-c", mounts + command]
            cwd = Path("/")
        if self.namespaces:
            argv = [shutil.which("unshare") or "unshare", "--pid", "--fork", "--kill-child=SIGKILL",
                    "--mount-proc", "--", *argv]
        with open(home / "console.log", "ab") as out:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)

    def _bare_env(self, home: Path) -> dict[str, str]:
        """A bare image's node: its Python (pip only) first on PATH (no PYTHONPATH), the pinned uv
        wheel served by a package index on 127.0.0.1, and uv told to install offline from the cache
        ``./dev`` filled (the same path as on AWS, the index swapped for the cache)."""
        from support.wheel_index import uv_index

        image = bare_image()
        self.env_root.mkdir(parents=True, exist_ok=True)
        return {
            "PATH": f"{home / 'bin'}:{image / 'bin'}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR") or str(Path.home() / ".cache" / "uv"),
            "UV_OFFLINE": "1", "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1",
            "PREFECT_SGPU_ENV_ROOT": str(self.env_root),
            "PREFECT_SGPU_UV_INDEX": uv_index().url,
        }

    @staticmethod
    def _profile_name(inst: dict[str, Any]) -> str:
        """The name of the instance profile the instance was launched with ("" for none)."""
        return (inst.get("IamInstanceProfile") or {}).get("Arn", "").split("/")[-1]

    def _control_client(self, service: str) -> Any:
        """A client of the simulator's own (:attr:`control_plane_url`), with the admin keys of ``aws_env``;
        one session for the simulator, used under its lock (a boto3 session is not shared across threads)."""
        if service not in self._control:
            if "session" not in self._control:
                import boto3
                import botocore.session

                from support.aws_fixtures import shared_data_loader

                core = botocore.session.get_session()
                core.register_component("data_loader", shared_data_loader())
                self._control["session"] = boto3.Session(
                    aws_access_key_id=self.aws_env.get("AWS_ACCESS_KEY_ID"),
                    aws_secret_access_key=self.aws_env.get("AWS_SECRET_ACCESS_KEY"),
                    region_name=self.ec2.meta.region_name, botocore_session=core)
            self._control[service] = self._control["session"].client(
                service, endpoint_url=self.control_plane_url or self.ec2.meta.endpoint_url)
        return self._control[service]

    def _role_credentials(self, inst: dict[str, Any]) -> dict[str, str]:
        """IMDS entries of the instance profile's role (temporary keys from STS), as EC2 serves them to
        every instance launched with the profile (AWS docs, "Retrieve security credentials from instance
        metadata"); empty when the instance has no profile. A profile that stays unreadable for
        :attr:`profile_wait_s` (IAM is eventually consistent: "Changes that I make are not always
        immediately visible", IAM User Guide) or that holds no role gives no keys: on EC2 an instance whose
        profile has no role gets none from IMDS. That case is recorded in :attr:`profile_errors` and logged
        loudly, and the caller boots the node with no keys at all, never the admin keys."""
        profile = self._profile_name(inst)
        if not profile:
            return {}
        from prefect_sgpu import retry

        iid = inst["InstanceId"]

        def not_visible_yet(exc: BaseException) -> bool:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            return code in ("NoSuchEntity", "Throttling") or type(exc).__name__ == "EndpointConnectionError"

        try:
            found = retry.retrying(
                lambda: self._control_client("iam").get_instance_profile(InstanceProfileName=profile),
                transient=not_visible_yet, budget_s=self.profile_wait_s, base_s=0.5, cap_s=5.0,
                what=f"instance profile {profile} of {iid}")
            roles = found["InstanceProfile"].get("Roles") or []
            if not roles:
                raise LookupError(f"instance profile {profile} has no role")
            role = roles[0]
            creds = self._control_client("sts").assume_role(
                RoleArn=role["Arn"], RoleSessionName=iid, DurationSeconds=43200)["Credentials"]
        except Exception as exc:  # noqa: BLE001 - the node boots with no keys; tests read profile_errors
            self.profile_errors[iid] = (f"instance profile {profile}: {type(exc).__name__}: {exc}; the node has "
                                        "no credentials (IMDS answers 404 for iam/security-credentials/)")
            _LOG.error("ec2-simulator: %s: %s", iid, self.profile_errors[iid])
            return {}
        document = {"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": creds["AccessKeyId"],
                    "SecretAccessKey": creds["SecretAccessKey"], "Token": creds["SessionToken"],
                    "Expiration": creds["Expiration"].strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "LastUpdated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        return {"iam/security-credentials/": role["RoleName"],
                f"iam/security-credentials/{role['RoleName']}": json.dumps(document)}

    def _install_shutdown(self, home: Path, instance_id: str) -> None:
        """The node's ``shutdown``: what instance-initiated shutdown with behaviour "terminate" does on EC2
        (the instance is terminated), recorded in ``shutdown.log``."""
        bin_dir = home / "bin"
        bin_dir.mkdir(exist_ok=True)
        script = bin_dir / "shutdown"
        # shutdown(8): "+m" or "hh:mm" schedules (systemd holds it; the call returns), "-c" cancels,
        # "now" (or none, "+0") powers off at once
        script.write_text(
            "#!/bin/bash\n"
            'when=now\n'
            'for arg in "$@"; do\n'
            f'  case "$arg" in -c) echo "shutdown $*" >> {home / "scheduled-shutdown.log"}; '
            f'rm -f {home / "scheduled-shutdown"}; exit 0 ;;\n'
            '    -*) ;;\n'
            '    *) when="$arg"; break ;;\n'
            '  esac\n'
            'done\n'
            'if [ "$when" != now ] && [ "$when" != +0 ]; then\n'
            f'  echo "shutdown $*" >> {home / "scheduled-shutdown.log"}\n'
            f'  echo "$when" > {home / "scheduled-shutdown"}\n'
            '  exit 0\n'
            'fi\n'
            f'echo "shutdown $*" >> {home / "shutdown.log"}\n'
            f"exec {sys.executable} -c 'import boto3; boto3.client(\"ec2\", "
            f"endpoint_url=\"{self.ec2.meta.endpoint_url}\", region_name=\"{self.ec2.meta.region_name}\")"
            f".terminate_instances(InstanceIds=[\"{instance_id}\"])'\n"
        )
        script.chmod(0o755)

    def shutdowns(self, instance_id: str) -> str:
        """What the node's ``shutdown`` was called with to power off now ("" when never)."""
        log = self.workdir / instance_id / "shutdown.log"
        return log.read_text() if log.exists() else ""

    def scheduled_shutdowns(self, instance_id: str) -> str:
        """What the node's ``shutdown`` was called with to schedule (``+m``, ``hh:mm``) or cancel (``-c``)."""
        log = self.workdir / instance_id / "scheduled-shutdown.log"
        return log.read_text() if log.exists() else ""

    def scheduled_shutdown(self, instance_id: str) -> str | None:
        """The node's pending scheduled shutdown (``+m`` or ``hh:mm``); None when none is pending."""
        pending = self.workdir / instance_id / "scheduled-shutdown"
        return pending.read_text().strip() if pending.exists() else None

    def end_lifetime(self, instance_id: str) -> bool:
        """The node's scheduled shutdown comes due (as its minutes passing would): EC2 terminates the
        instance (shutdown behaviour "terminate"), whether or not any process of the node still runs.
        False when none was pending."""
        if self.scheduled_shutdown(instance_id) is None:
            return False
        with open(self.workdir / instance_id / "shutdown.log", "a") as log:
            log.write("scheduled shutdown came due\n")
        self.ec2.terminate_instances(InstanceIds=[instance_id])
        return True

    def per_boot_dir(self, instance_id: str) -> Path:
        """Where the node's cloud-init per-boot scripts are (in the node's folder)."""
        home = self.workdir / instance_id
        return home / "var-lib" / "cloud" / "scripts" / "per-boot" if self.cloud_init else home / "per-boot"

    def _power_off(self, node: SimulatedNode) -> None:
        """What terminating a VM does: every process of the node dies at once."""
        import psutil

        node.killed = True
        try:
            tree = [psutil.Process(node.proc.pid), *psutil.Process(node.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.errors.append(f"{node.instance_id}: process {node.proc.pid} survived SIGKILL")
        remove_machine_cgroups(node.instance_id)

    # -- what the cloud does to running instances ---------------------------------------

    def reclaim(self, instance_id: str, after: float = 3.0, action: str = "terminate") -> threading.Thread:
        """A spot interruption: IMDS serves ``spot/instance-action`` at once, and ``after`` seconds
        later EC2 terminates the instance (two minutes on AWS; shorter here)."""
        import datetime as _dt

        node = self.nodes[instance_id]
        when = _dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(seconds=after)
        node.imds.metadata["spot/instance-action"] = json.dumps(
            {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")})

        def terminate() -> None:
            time.sleep(after)
            try:
                self.ec2.terminate_instances(InstanceIds=[instance_id])
            except Exception as exc:  # noqa: BLE001 - tests read .errors
                self.errors.append(f"reclaiming {instance_id}: {exc}")

        thread = threading.Thread(target=terminate, name=f"reclaim-{instance_id}", daemon=True)
        thread.start()
        return thread

    def rebalance(self, instance_id: str, reclaim_after: float | None = None,
                  terminate_after: float = 3.0) -> threading.Thread | None:
        """A rebalance recommendation: IMDS serves ``events/recommendations/rebalance`` (``{"noticeTime":
        ...}``) from now on. It is a warning, not a notice: with ``reclaim_after`` None nothing follows
        (the instance keeps running); else ``reclaim_after`` seconds later a spot interruption follows
        (:meth:`reclaim`, the instance terminated ``terminate_after`` seconds after that). AWS docs, "EC2
        instance rebalance recommendations": a recommendation can arrive before, with, or without
        any interruption notice
        (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html)."""
        import datetime as _dt

        node = self.nodes[instance_id]
        now = _dt.datetime.now(_dt.timezone.utc)
        node.imds.metadata["events/recommendations/rebalance"] = json.dumps(
            {"noticeTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")})
        if reclaim_after is None:
            return None

        def interrupt() -> None:
            time.sleep(reclaim_after)
            try:
                self.reclaim(instance_id, after=terminate_after)
            except Exception as exc:  # noqa: BLE001 - tests read .errors
                self.errors.append(f"interrupting {instance_id} after its rebalance: {exc}")

        thread = threading.Thread(target=interrupt, name=f"rebalance-{instance_id}", daemon=True)
        thread.start()
        return thread
    def reboot(self, instance_id: str) -> None:
        """A reboot (``RebootInstances``, a kernel panic, maintenance): every process of the node dies, a
        scheduled shutdown is lost (systemd keeps it in /run), and at boot cloud-init runs the per-boot
        scripts (``/var/lib/cloud/scripts/per-boot``, in name order) but not the user-data again (it ran
        once for this instance). The instance stays running in EC2 throughout."""
        with self._lock:
            node = self.nodes[instance_id]
            self._power_off(node)
            (self.workdir / instance_id / "scheduled-shutdown").unlink(missing_ok=True)
            home = self.workdir / instance_id
            scripts = self.per_boot_dir(instance_id)
            where = "/var/lib/cloud/scripts/per-boot" if self.cloud_init else str(scripts)
            with open(home / "console.log", "ab") as out:
                out.write(b"--- reboot: cloud-init runs the per-boot scripts ---\n")
            node.proc = self._run_on_node(home, node.info["env"],
                                          f'for f in {where}/*; do [ -x "$f" ] && "$f"; done; true')
            node.killed = False

    def freeze(self, instance_id: str) -> None:
        """A hung VM: every process of the node stops (SIGSTOP) and nothing on it runs again
        until the instance is terminated (powering off kills stopped processes too)."""
        import psutil

        node = self.nodes[instance_id]
        try:
            tree = [psutil.Process(node.proc.pid), *psutil.Process(node.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in tree:
            try:
                proc.send_signal(signal.SIGSTOP)
            except psutil.NoSuchProcess:
                pass

    # -- what tests ask -------------------------------------------------------------

    def address_of(self, instance_id: str) -> tuple[str, str]:
        """(moto's private IP, the loopback address the node really uses)."""
        node = self.nodes[instance_id]
        return node.moto_ip, node.address

    def live_processes(self) -> list[int]:
        with self._lock:
            return [n.proc.pid for n in self.nodes.values() if n.proc.poll() is None]

    def console(self, instance_id: str) -> str:
        node = self.nodes.get(instance_id)
        return node.log.read_text(errors="replace") if node else ""

    def wait_powered_off(self, instance_ids: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                alive = [i for i in instance_ids if i in self.nodes and self.nodes[i].proc.poll() is None]
            if not alive:
                return True
            time.sleep(0.2)
        return False

    def describe(self) -> str:
        return json.dumps({i: {"index": n.launch_index, "moto_ip": n.moto_ip, "address": n.address,
                               "alive": n.proc.poll() is None} for i, n in self.nodes.items()}, indent=1)
