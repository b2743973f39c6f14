"""A built environment as one archive in the store: packed by the first node that builds it, unpacked by the next.

Standard library only, and runnable on the image's own Python (3.7 or later): the environment stage
(:mod:`prefect_sgpu.launch.node_env`) does not carry this file in the user-data (EC2 allows 16 KiB),
it loads it from the environment's own shipped prefect-sgpu files, each checked against the sha256
in the manifest the user-data names (:func:`prefect_sgpu.launch.node_env.pack_module`).

A pack holds a venv's *packages* (the Python, the pinned distributions, the extra requirements),
not the files shipped beside them (the project, local packages): it is keyed by the packages'
digest (:func:`prefect_sgpu.launch.node_env.packages_digest`), so a changed project file does
not make a new pack, and the shipped files are laid out after unpacking as after a build.

- **Offer.** Node 0 of a job whose driver asks for it (``--offer-pack``), having installed the
  packages cold, tars the venv (and the Python uv downloaded for it, when it lies under the
  environments' root) into ``.environments/packages-<packages digest>/<sha256>.tar`` (one PUT, or an
  upload in parts: S3 takes at most 5 GB in one PUT), then writes ``<run>/setup/pack-<instance>.json``: the pack's description sealed
  as :func:`prefect_sgpu.protocol.jobfolder.seal` seals a document of kind ``envpack`` bound to the instance,
  with the job key's ``env-pack`` key. All of this happens before the bootstrap starts: no rank has
  run. The driver reads the offer before it launches any rank and records the pack, sealed with a
  key only drivers hold (:func:`prefect_sgpu.environment.ship.take_offers`).
- **Unpack.** A node that lacks the venv and whose user-data names a pack for its platform
  (``--pack``) downloads it (ranged GETs, 8 at a time), checks its sha256, checks every entry (plain
  files, folders and links that stay inside ``venv/`` or ``python/<name>/``; an absolute link only as
  one of the venv's interpreters; no setuid bits; each name once, none under a link, so nothing is
  written through a link; every relative link, resolved as extracted, inside its folder), unpacks it under the environments' root, moves
  the venv's home to where the packed Python now lies, and checks that the venv's Python runs as
  the manifest's version. Anything else: the stage logs why and builds as before.

The venv is relocatable (``uv venv --relocatable``; the ``.pth`` of shipped trees names them relative
to site-packages), so the pack works under another root than the builder's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PACK_FORMAT = 1
COMPLETE = ".complete"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class PackError(Exception):
    """The pack cannot be made or used here: the stage says why and builds instead."""


def log(message: str) -> None:
    print(f"[prefect-sgpu env] {message}", flush=True)


def part_size(size: int) -> int:
    """Upload parts and download ranges: 8 MiB, 64 MiB from 1 GiB (at most 10,000 parts: 640 GiB)."""
    return max(8 << 20 if size < (1 << 30) else 64 << 20, -(-size // 10_000))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- large objects, through the stage's transport (:class:`prefect_sgpu.launch.node_env.Transport`) ----------


def upload(store, key: str, path: Path, part: int) -> None:
    """A file of any size: one PUT up to ``part`` bytes, else an upload in parts (4 at a time),
    abandoned when a part fails."""
    size = path.stat().st_size
    if size <= part:
        store.put(key, path.read_bytes(), "application/x-tar")
        return
    upload_id = store.start_upload(key)

    def send(number: int) -> str:
        with open(path, "rb") as fh:
            fh.seek((number - 1) * part)
            return store.put_part(key, upload_id, number, fh.read(part))

    try:
        with ThreadPoolExecutor(4) as pool:
            parts = list(pool.map(send, range(1, -(-size // part) + 1)))
        store.finish_upload(key, upload_id, parts)
    except BaseException:
        try:
            store.finish_upload(key, upload_id, [])
        except Exception:  # noqa: BLE001 - the upload's own error says more
            pass
        raise


def download(store, key: str, path: Path, size: int, part: int) -> str:
    """An object of ``size`` bytes into ``path`` (ranges of ``part`` bytes, 8 at a time): its sha256."""
    with open(path, "wb") as fh:
        fh.truncate(size)
    fd = os.open(str(path), os.O_WRONLY)

    def fetch(start: int) -> None:
        end = min(start + part, size) - 1
        got = store.get_range(key, start, end)
        if len(got) != end - start + 1:
            raise PackError(f"{store.uri(key)}: {len(got)} bytes at {start}, not {end - start + 1}")
        os.pwrite(fd, got, start)

    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(fetch, range(0, size, part)))
    finally:
        os.close(fd)
    return file_sha256(path)


# --- the archive ---------------------------------------------------------------------------------


def venv_home(venv: Path) -> str:
    for line in (venv / "pyvenv.cfg").read_text().splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "home":
            return value.strip()
    raise PackError(f"{venv / 'pyvenv.cfg'} names no home")


class _Hashing:
    """A write-only file that hashes what passes through it."""

    def __init__(self, raw) -> None:
        self.raw, self.digest, self.size = raw, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.raw.write(data)


def pack(venv: Path, out: Path) -> "tuple[str, int]":
    """A tar of ``venv`` (as ``venv/``) and of the uv-managed Python it runs on, when that lies under the
    environments' root (as ``python/<name>/``): (its sha256, its size)."""
    members = [(venv, "venv")]
    pythons = venv.parent / "python"
    home = Path(venv_home(venv))
    if pythons in home.parents:
        name = home.relative_to(pythons).parts[0]
        members.append((pythons / name, f"python/{name}"))
    with open(out, "wb") as raw:
        hashing = _Hashing(raw)
        with tarfile.open(fileobj=hashing, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for path, arcname in members:
                tar.add(str(path), arcname, filter=lambda info: None if info.name == f"venv/{COMPLETE}" else info)
    return hashing.digest.hexdigest(), hashing.size


def check_member(member: tarfile.TarInfo) -> None:
    """A pack's entry, refused unless a plain file, folder or link under ``venv/`` or ``python/<name>/``
    that stays there (an absolute link only as one of the venv's own interpreters, moved in unpack)."""
    name = member.name
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise PackError(f"entry {name!r} is not allowed: a relative path without empty, '.' or '..' parts")
    if not (parts[0] == "venv" or (parts[0] == "python" and len(parts) > 1 and NAME.match(parts[1]))):
        raise PackError(f"entry {name!r} is neither under venv/ nor python/<name>/")
    top = parts[0] if parts[0] == "venv" else "/".join(parts[:2])
    if member.issym():
        if member.linkname.startswith("/"):
            if not (len(parts) == 3 and parts[1] == "bin" and parts[2].startswith("python")):
                raise PackError(f"{name!r} links to {member.linkname!r}")
        else:
            target = os.path.normpath(os.path.join(os.path.dirname(name), member.linkname))
            if target != top and not target.startswith(top + "/"):
                raise PackError(f"{name!r} links to {member.linkname!r}, outside {top}/")
    elif not (member.isreg() or member.isdir()):
        raise PackError(f"{name!r} is not a file, folder or link")
    member.mode &= 0o755  # no setuid, setgid or sticky bit, nothing writable by others
    member.uid, member.gid, member.uname, member.gname = os.getuid(), os.getgid(), "", ""


def check_tree(members: "list[tarfile.TarInfo]") -> None:
    """The entries as a tree: each name once, and none under a link an earlier or later entry makes
    (extraction would write through it, wherever it points)."""
    seen, links = set(), set()
    for member in members:
        if member.name in seen:
            raise PackError(f"entry {member.name!r} appears twice")
        seen.add(member.name)
        if member.issym():
            links.add(member.name)
    for member in members:
        parts = member.name.split("/")
        for end in range(1, len(parts)):
            above = "/".join(parts[:end])
            if above in links:
                raise PackError(f"entry {member.name!r} lies under the link {above!r}")


def check_links(staging: Path, members: "list[tarfile.TarInfo]") -> None:
    """Every relative link as extracted, resolved through the links beside it, stays in its ``venv/`` or
    ``python/<name>/`` (a chain such as ``l1 -> l0/..`` is lexically inside and resolves outside)."""
    for member in members:
        if not member.issym() or member.linkname.startswith("/"):
            continue
        parts = member.name.split("/")
        top = os.path.realpath(str(staging.joinpath(*(parts[:1] if parts[0] == "venv" else parts[:2]))))
        # the folder it names, resolved; a last part that is itself a link is an entry checked on its own
        named = os.path.join(os.path.dirname(str(staging / member.name)), member.linkname)
        last = os.path.basename(named)
        if last in ("", ".", ".."):
            target = os.path.realpath(named)
        else:
            target = os.path.join(os.path.realpath(os.path.dirname(named)), last)
        if target != top and not target.startswith(top + os.sep):
            raise PackError(f"{member.name!r} links to {member.linkname!r}, which resolves outside its folder")


def _move_home(venv: Path, root: Path, packed: "list[str]") -> None:
    """The venv's home and interpreter links, from the packed Python's place under the builder's root
    to its place under ``root``."""
    cfg = venv / "pyvenv.cfg"
    old_home = venv_home(venv)
    for name in packed:
        marker = f"/python/{name}"
        if marker + "/" not in old_home + "/":
            continue
        old_prefix = old_home.split(marker, 1)[0] + marker
        new_prefix = str(root / "python" / name)
        cfg.write_text(cfg.read_text().replace(old_home, new_prefix + old_home[len(old_prefix):]))
        for link in (venv / "bin").iterdir():
            if link.is_symlink() and os.readlink(str(link)).startswith(old_prefix + "/"):
                target = new_prefix + os.readlink(str(link))[len(old_prefix):]
                link.unlink()
                link.symlink_to(target)


def unpack(archive: Path, root: Path, venv: Path, python: str) -> None:
    """The pack at ``archive`` as the venv ``venv`` under ``root`` (its Python, when packed, under
    ``root/python/``), checked to run as Python ``python`` (major.minor) before it is moved in place."""
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=str(root)))
    try:
        with tarfile.open(str(archive)) as tar:
            members = tar.getmembers()
            for member in members:
                check_member(member)
            check_tree(members)
            # every entry checked above, and none is written through a link: the fully trusted filter
            # keeps the venv's absolute interpreter links, which the data filter refuses
            options = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
            tar.extractall(str(staging), members, **options)
        check_links(staging, members)
        packed = sorted(p.name for p in (staging / "python").iterdir()) if (staging / "python").is_dir() else []
        for name in packed:
            if not (root / "python" / name).exists():
                (root / "python").mkdir(exist_ok=True)
                os.replace(str(staging / "python" / name), str(root / "python" / name))
        _move_home(staging / "venv", root, packed)
        done = subprocess.run([str(staging / "venv" / "bin" / "python"), "-c",
                               "import sys; print('%d.%d' % sys.version_info[:2])"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
        if done.returncode != 0 or done.stdout.strip() != python:
            raise PackError(f"its Python does not run here as {python}: {done.stdout.strip()[-500:]}")
        os.replace(str(staging / "venv"), str(venv))
    finally:
        shutil.rmtree(str(staging), ignore_errors=True)


def from_pack(store, packs_key: str, sha: str, size: int, root: Path, venv: Path, python: str) -> None:
    """The pack ``sha`` of ``size`` bytes from the store, checked, as the venv ``venv``."""
    started = time.monotonic()
    archive = root / f".pack-{os.getpid()}.tar"
    try:
        found = download(store, f"{packs_key}/{sha}.tar", archive, size, part_size(size))
        if found != sha:
            raise PackError(f"{packs_key}/{sha}.tar has sha256 {found}")
        unpack(archive, root, venv, python)
    finally:
        if archive.exists():
            archive.unlink()
    log(f"unpacked the store's pack {sha[:16]} ({size / 2**20:.1f} MiB) in {time.monotonic() - started:.1f}s")


def seal_offer(job_key: str, run_id: str, instance: str, body: bytes) -> bytes:
    """``body`` sealed as :func:`prefect_sgpu.protocol.jobfolder.seal` seals a document of kind ``envpack`` bound
    to this instance, with the job key's ``env-pack`` key (:func:`prefect_sgpu.protocol.jobfolder.derive_key`)."""
    key = hmac.new(bytes.fromhex(job_key), b"env-pack", hashlib.sha256).digest()
    header = json.dumps({"v": 2, "kind": "envpack", "run_id": run_id, "node": None, "rank": None,
                         "instance_id": instance}, sort_keys=True).encode()
    message = len(header).to_bytes(4, "big") + header + body
    return b"SGPU2\n" + hmac.new(key, message, hashlib.sha256).digest() + message


def offer(store, packs_key: str, offer_key: str, venv: Path, manifest: dict, packages: str, platform: str, read_key,
          run_id: str, instance: str) -> None:
    """Pack ``venv`` (its packages installed, nothing shipped laid out yet), put the pack in the store under
    ``packs_key``, and offer it to the driver (see the module doc). ``packages``: the packages' digest."""
    started = time.monotonic()
    archive = venv.parent / f".pack-{os.getpid()}.tar"
    try:
        sha, size = pack(venv, archive)
        upload(store, f"{packs_key}/{sha}.tar", archive, part_size(size))
        body = json.dumps({"format": PACK_FORMAT, "packages": packages, "platform": platform,
                           "python": manifest["python"], "sha256": sha, "size": size}, sort_keys=True).encode()
        store.put(offer_key, seal_offer(read_key(), run_id, instance, body), "application/octet-stream")
    finally:
        if archive.exists():
            archive.unlink()
    log(f"packed the packages {packages[:16]} of environment {manifest['digest'][:16]} ({size / 2**20:.1f} MiB, sha256 {sha[:16]}) into the "
        f"store in {time.monotonic() - started:.1f}s")
