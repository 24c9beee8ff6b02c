"""Checkpoints in an object store (``checkpoint.dir`` = an fsspec URL: ``s3://``, ``gs://``, an S3-compatible endpoint).

``RemotePath`` is the part of ``pathlib.Path`` that reading a checkpoint uses (``/``, ``name``, ``parent``,
``is_file``, ``read_text``, ``glob``, ``stat().st_size`` ...), over fsspec: discovery, validation, the
compatibility checks and the restricted loading read a remote checkpoint with the code that reads a local one.
It has no ``__fspath__`` on purpose: handing one to ``open`` or ``os`` is a bug, not a silent local write.

An object store has no rename and no symlink, so what a rename and a link give on disk is given by objects
written last (the layout and the invariants are in ``remote_manager``). Credentials are never treadle's:
fsspec's backend finds them where its library looks (s3fs/boto: ``AWS_*`` variables, ``~/.aws``, an instance
role; gcsfs: ``GOOGLE_APPLICATION_CREDENTIALS`` ...) and the endpoint likewise (``AWS_ENDPOINT_URL``). The config
holds the URL only, and no message treadle writes quotes a credential.
"""

from __future__ import annotations

import fnmatch
import posixpath
import types
import uuid
from pathlib import Path, PurePosixPath

from treadle.errors import UserError, first_line

COMMITTED = "COMMITTED"  # the object that makes a step_<N>/ prefix a checkpoint: written after every other one

# fsspec's own table says which package serves a scheme; these are the usual ones, for a message without fsspec.
_ACCEPTED = "accepted: a local path, or a URL of an installed fsspec backend (s3:// with s3fs, gs:// with gcsfs, ...)"


def dcp_fsspec():
    """DCP's fsspec storage module (FsspecReader, FsspecWriter), imported on first use: only a run with an object
    store pays for fsspec. Public in newer torch (2.15: the private name warns); torch 2.11 has only the private one."""
    try:
        from torch.distributed.checkpoint import fsspec_filesystem
    except ImportError:  # pragma: no cover - the oldest torch
        from torch.distributed.checkpoint import _fsspec_filesystem as fsspec_filesystem
    return fsspec_filesystem


def is_url(value: str | Path) -> bool:
    """Whether ``value`` names an object store (``scheme://``) rather than a local path (``file://`` is local)."""
    return isinstance(value, str) and "://" in value and not value.startswith("file://")


def as_path(value: str | Path | RemotePath) -> Path | RemotePath:
    """A checkpoint location as the code reads it: ``RemotePath`` for a URL, ``Path`` otherwise."""
    if isinstance(value, (Path, RemotePath)):
        return value
    if is_url(value):
        return RemotePath(value)
    return Path(value[len("file://"):] if value.startswith("file://") else value)


def filesystem(url: str, key: str = "checkpoint.dir"):
    """``(fs, path)`` for ``url``; a one-line UserError naming the package to install for an unknown scheme."""
    import fsspec
    from fsspec.registry import known_implementations

    scheme, rest = url.split("://", 1)
    if "@" in rest.split("/", 1)[0]:  # s3://KEY:SECRET@bucket: a credential in a config file, and in every log line
        raise UserError(f"{key} holds credentials before its bucket ('user@' or 'key:secret@'); accepted: the URL "
                        "alone, credentials in the environment or the backend's own configuration")
    try:
        # No listings cache: a checkpoint listing must see the objects this run (or another rank) just wrote.
        return fsspec.core.url_to_fs(url, use_listings_cache=False)
    except ImportError:
        need = known_implementations.get(scheme, {}).get("err") or f"the fsspec backend for {scheme}://"
        raise UserError(f"{key} = {url!r}: no installed fsspec backend handles {scheme}:// ({need}); "
                        f"{_ACCEPTED}") from None
    except (ValueError, OSError) as exc:
        raise UserError(f"{key} = {url!r}: fsspec cannot open {scheme}:// ({first_line(exc)}); {_ACCEPTED}") from None


class RemotePath:
    """An object-store location named by its URL; every call is one or a few requests to the store."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self._fs = None

    def __getstate__(self):  # broadcast between ranks: each opens its own client
        return {"url": self.url, "_fs": None}

    @property
    def fs(self):
        if self._fs is None:
            self._fs, self._key = filesystem(self.url)
        return self._fs

    @property
    def key(self) -> str:
        """The path inside the store (no scheme): what the fsspec filesystem's methods take."""
        self.fs
        return self._key

    # ------------------------------------------------------------------ pure path parts

    def __truediv__(self, part: str) -> RemotePath:
        return RemotePath(f"{self.url}/{str(part).strip('/')}")

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: RemotePath) -> bool:
        return self.url < other.url

    @property
    def name(self) -> str:
        return posixpath.basename(self.url.split("://", 1)[1])

    @property
    def parent(self) -> RemotePath:
        scheme, rest = self.url.split("://", 1)
        return RemotePath(f"{scheme}://{posixpath.dirname(rest) or rest}")

    def resolve(self) -> RemotePath:
        return self

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        if not self.is_relative_to(other):
            raise ValueError(f"{self} is not under {other}")
        return PurePosixPath(self.url[len(other.url):].lstrip("/"))

    def is_relative_to(self, other) -> bool:
        return isinstance(other, RemotePath) and (self.url == other.url or self.url.startswith(other.url + "/"))

    # ------------------------------------------------------------------ reading

    def exists(self) -> bool:
        return self.fs.exists(self.key)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.key)

    def is_file(self) -> bool:
        return self.fs.isfile(self.key)

    def is_symlink(self) -> bool:
        return False

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.key)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def open(self, mode: str = "rb"):
        return self.fs.open(self.key, mode)

    def stat(self):
        return types.SimpleNamespace(st_size=int(self.fs.info(self.key)["size"]))

    def iterdir(self) -> list[RemotePath]:
        try:
            entries = self.fs.ls(self.key, detail=False)
        except FileNotFoundError:
            return []
        return [self / posixpath.basename(e.rstrip("/")) for e in sorted(entries) if e.rstrip("/") != self.key]

    def glob(self, pattern: str) -> list[RemotePath]:
        """Entries directly under this prefix whose name matches ``pattern`` (one level, as the callers use it)."""
        return [p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)]

    # ------------------------------------------------------------------ writing

    def write_text(self, text: str) -> None:
        """One PUT: readers see the old object or the new one, never part of it."""
        self.fs.pipe_file(self.key, text.encode())

    def remove(self) -> None:
        """Delete this object or everything under this prefix; a step's ``COMMITTED`` goes first, so a kill
        in the middle leaves an uncommitted prefix (invisible, cleared at the next start), never a damaged step."""
        try:
            if self.fs.isfile(f"{self.key}/{COMMITTED}"):
                self.fs.rm_file(f"{self.key}/{COMMITTED}")
            self.fs.rm(self.key, recursive=True)
        except FileNotFoundError:
            pass


def check_store(root: RemotePath, key: str = "checkpoint.dir") -> None:
    """Before anything is written: the scheme has a backend, the endpoint answers, the bucket exists and this
    process may write there (one small object written and deleted). One-line UserError otherwise."""
    fs, where = root.fs, root.key
    bucket = where.split("/", 1)[0]
    probe = f"{where}/.treadle-write-test-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except BaseException as exc:  # botocore's errors are no OSErrors; interrupts pass through
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise UserError(f"{key} = {root.url!r}: {_store_problem(exc, bucket)}") from None


def _store_problem(exc: BaseException, bucket: str) -> str:
    """What went wrong in words, never with a credential (the exceptions' texts hold none: checked by tests)."""
    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    names = {type(c).__name__ for c in chain}
    text = " ".join(first_line(c) for c in chain)
    creds = ("the store refused this process's credentials or found none; accepted: credentials where the "
             "backend's library looks for them (for s3://: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
             "AWS_PROFILE, ~/.aws/credentials or an instance role), never in the config file")
    if names & {"NoCredentialsError", "PartialCredentialsError"} or "credentials" in text.lower():
        return creds
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionError", "ClientConnectorError",
                "ConnectionRefusedError", "gaierror"} or "connect" in text.lower():
        return (f"the object store cannot be reached ({first_line(chain[0])}); accepted: a reachable endpoint "
                "(for an S3-compatible store: AWS_ENDPOINT_URL or the backend's own configuration)")
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower() or isinstance(exc, FileNotFoundError):
        return f"the bucket {bucket!r} does not exist; accepted: an existing bucket (treadle creates no buckets)"
    if isinstance(exc, PermissionError) or names & {"InvalidAccessKeyId", "SignatureDoesNotMatch"}:
        return creds
    return f"cannot be written ({type(exc).__name__}: {first_line(exc)}); accepted: a location this process can write"
