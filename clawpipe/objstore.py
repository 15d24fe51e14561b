"""Object storage shared by the proxy (uploads captures) and the lake (lands them, commits on it).

URLs are fsspec URLs: ``s3://bucket/prefix`` (s3fs, the ``s3`` extra; the endpoint and credentials come
from the usual AWS variables, ``AWS_ENDPOINT_URL`` for an S3-compatible server), ``memory://x`` in tests,
or a local path. Listings are never cached: several hosts write under one prefix, and a stale listing
would hide their files.

Capture layout under ``<CLAWPIPE_LAKE_URI>/captures``: each proxy's sealed segments under
``<host>/<segment>.seg`` and the rollout result files of its host under ``results/<host>/...``, so the
prefix reads as one captures folder (:mod:`clawpipe.lake.sources`) with keys unique across hosts.
Sealed segments never change, so an upload is confirmed by the stored size, and uploading again is
harmless (the same bytes under the same name). Result files only grow: each upload replaces the object
with a longer prefix of the same lines.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
import socket
import uuid
from pathlib import Path
from typing import Any

from clawpipe.errors import LakeError

log = logging.getLogger(__name__)

CAPTURES = "captures"  # the capture prefix under a lake URI
HOST_ENV = "CLAWPIPE_HOST_ID"


def is_remote(url: str | os.PathLike[str]) -> bool:
    text = os.fspath(url)
    return "://" in text and text.split("://", 1)[0] not in ("file", "local")


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a URL; listings are not cached (other hosts write too)."""
    import fsspec

    scheme = url.split("://", 1)[0]
    opts: dict[str, Any] = {"use_listings_cache": False} if scheme in ("s3", "s3a") else {}
    try:
        fs, path = fsspec.core.url_to_fs(url, **opts)
    except (ImportError, ValueError) as exc:
        raise LakeError(
            f"cannot open {url!r}: {exc}; install the fsspec implementation for {scheme}:// (clawpipe[s3] for s3://)"
        ) from exc
    return fs, path.rstrip("/")


def create_exclusive(fs: Any, path: str, data: bytes) -> bool:
    """Write ``data`` at ``path`` only if nothing is there; False when something is.

    On S3 this is a PUT with ``If-None-Match: *``: the store itself decides, so of two hosts creating one
    name exactly one succeeds, and the object appears whole or not at all. Every commit of the lake and
    every shard outcome rests on that, so the first use of a store checks that it really refuses the
    second create (:func:`require_conditional_create`).
    """
    require_conditional_create(fs, posixpath.dirname(path))
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    return True


# (filesystem, bucket) pairs seen to refuse a second create of one name; the check runs once per process
_CONDITIONAL_OK: set[tuple[str, str]] = set()
_PROBE_PREFIX = ".clawpipe-conditional-probe-"  # never a .json, .seg or .parquet name: no listing reads it


def require_conditional_create(fs: Any, folder: str) -> None:
    """Raise LakeError unless the store under ``folder`` refuses to create a name twice.

    Some S3-compatible stores ignore ``If-None-Match: *`` and overwrite: on one of those two landings could
    both commit the same manifest entry (one batch's calls lost, or landed twice) and two workers could
    both record a shard. A probe object next to ``folder``'s files is created twice; the second create
    must be refused. The probe is deleted after (a store that forbids deletes keeps a few bytes).
    """
    # fsspec's token names a filesystem's construction arguments; the endpoint may also come from the environment
    token = str(getattr(fs, "_fs_token", id(fs)))
    key = (
        f"{type(fs).__qualname__}:{token}:{os.environ.get('AWS_ENDPOINT_URL', '')}",
        folder.lstrip("/").split("/", 1)[0],
    )
    if key in _CONDITIONAL_OK:
        return
    probe = posixpath.join(folder, f"{_PROBE_PREFIX}{uuid.uuid4().hex}")
    try:
        fs.pipe_file(probe, b"first", mode="create")
        try:
            fs.pipe_file(probe, b"second", mode="create")
        except FileExistsError:
            _CONDITIONAL_OK.add(key)
            return
    finally:
        try:
            fs.rm_file(probe)
        except OSError as exc:
            log.warning("could not delete the conditional-write probe %s: %s", probe, exc)
    raise LakeError(
        f"the object store holding {folder} overwrote an object created with If-None-Match: * instead of "
        "refusing the second create: it does not support conditional writes, on which every lake commit and "
        "shard outcome rests (two landings could both commit). Use a store that supports them (AWS S3, "
        "MinIO, Cloudflare R2 and moto do; check your store's documentation for If-None-Match on PUT) "
        "or a lake on a local or shared disk"
    )


HOST_ID_RULE = "use 1-128 letters, digits, '.', '_' or '-'"


def valid_host_id(name: str) -> bool:
    """Whether ``name`` may name a capture host: a path component of the store's keys, so no "/" or ".."
    that would lead under another prefix."""
    return name not in (".", "..") and re.fullmatch(r"[A-Za-z0-9._-]{1,128}", name) is not None


def host_id(capture_dir: str | os.PathLike[str]) -> str:
    """A stable name for this capture host: ``CLAWPIPE_HOST_ID``, else hostname + a hash of the folder
    (two homes on one machine are two hosts)."""
    explicit = os.environ.get(HOST_ENV, "").strip()
    if explicit:
        if not valid_host_id(explicit):
            raise ValueError(f"{HOST_ENV}={explicit!r}: {HOST_ID_RULE}")
        return explicit
    digest = hashlib.sha1(str(Path(capture_dir).resolve()).encode()).hexdigest()[:8]
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname()) or "host"
    return f"{name}-{digest}"


def captures_url(lake_uri: str) -> str:
    return f"{lake_uri.rstrip('/')}/{CAPTURES}"


def remote_name(capture_dir: Path, local: Path, host: str) -> str | None:
    """Where a local capture file goes under the capture prefix; None for files that are not uploaded."""
    rel = local.relative_to(capture_dir)
    if rel.parts[0] == "results":
        return "/".join(("results", host, *rel.parts[1:])) if local.suffix == ".jsonl" else None
    if local.name.endswith(".seg") and len(rel.parts) == 1:
        return f"{host}/{local.name}"
    return None


def mirror(url: str, cache_dir: Path) -> Path:
    """Copy what is new under the capture prefix ``url`` into ``cache_dir`` (sizes decide: sealed segments
    never change, result files only grow); returns ``cache_dir``, laid out as a local captures folder."""
    fs, root = filesystem(url)
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return cache_dir
    copied = 0
    for path, info in sorted(found.items()):
        rel = path[len(root) :].lstrip("/")
        if not rel or not (rel.endswith(".seg") or rel.endswith(".jsonl")) or ".." in rel.split("/"):
            continue
        local = cache_dir / rel
        size = int(info.get("size") or 0)
        if local.exists() and local.stat().st_size >= size:
            continue
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(local.name + ".part")
        fs.get_file(path, str(tmp))
        os.replace(tmp, local)  # a landing reads whole files only
        copied += 1
    log.info("mirrored captures url=%s files=%d into %s", url, copied, cache_dir)
    return cache_dir


CACHE_ENV = "CLAWPIPE_CAPTURE_CACHE"


def local_captures(captures: str | os.PathLike[str]) -> Path:
    """A captures folder to land from: the folder itself, or the local mirror of a capture prefix
    (under ``CLAWPIPE_CAPTURE_CACHE``, default the temp folder; one mirror per URL)."""
    text = os.fspath(captures)
    if not is_remote(text):
        return Path(text.split("://", 1)[1] if "://" in text else text)
    import tempfile

    base = Path(os.environ.get(CACHE_ENV) or tempfile.gettempdir())
    digest = hashlib.sha1(text.rstrip("/").encode()).hexdigest()[:16]
    return mirror(text, base / f"clawpipe-captures-{digest}")
