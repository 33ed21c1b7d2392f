"""Remote tier: a KV pool shared by several nodes, on an existing distributed store.

Backends: Mooncake Store (the KV-cache store of SGLang, vLLM and LMCache) and
Redis. A value is immutable and content-addressed, named
`kvgate/<fingerprint hex>/<key hex>`, and carries the block file's 4 KiB header
(fingerprint, key, size, checksum) before the payload, so every read is
verified as on disk. A put is visible only whole (both stores publish a value
atomically), is never an overwrite (a name that exists is left as it is), and
an evicted or expired value is simply a miss.

A store that does not answer makes the tier *unavailable*: every call is then
a miss (counted), never an error to the caller, while a background thread
connects afresh, trying every `retry_s`, so the tier comes back by itself.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Optional, Protocol, Sequence
from urllib.parse import urlsplit

import numpy as np
import torch

from cache_impl.cache import integrity
from cache_impl.cache.config import RemoteTierConfig
from cache_impl.cache.keys import Fingerprint, Key
from cache_impl.cache.tiers.base import Discovered, cpu_bytes


class StoreUnavailable(Exception):
    """The store did not answer (down, unreachable, timed out)."""


class RemoteStore(Protocol):
    def put(self, name: str, value: bytes) -> None: ...
    def get(self, name: str) -> Optional[bytes]: ...           # None: no such value
    def exists(self, names: Sequence[str]) -> list[bool]: ...
    def remove(self, name: str) -> None: ...
    def close(self) -> None: ...


class RedisStore:
    """Redis: SET NX (never an overwrite), GET, pipelined EXISTS."""

    def __init__(self, url: str, timeout_s: float) -> None:
        import redis  # deferred: the pool's clients are an optional extra (pip install kvgate[pool])

        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry_on_timeout=False)
        self._call(self._client.ping)  # connected means answering, as for Mooncake

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._errors as error:
            raise StoreUnavailable(f"redis: {error}") from None

    def put(self, name: str, value: bytes) -> None:
        self._call(self._client.set, name, value, None, None, True)  # nx=True

    def get(self, name: str) -> Optional[bytes]:
        return self._call(self._client.get, name)

    def exists(self, names: Sequence[str]) -> list[bool]:
        def run():
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return [bool(n) for n in pipe.execute()]
        return self._call(run)

    def remove(self, name: str) -> None:
        self._call(self._client.delete, name)

    def close(self) -> None:
        self._client.close()


MOONCAKE_LISTENERS = (
    "mooncake: this node's transfer engine listens on every interface, on two ports from "
    "MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (default 15000-17000): its handshake daemon (0.0.0.0) and its TCP "
    "data listener (::); Mooncake has no setting to bind them to one address, so firewall that range "
    "(see the README's shared pool section)")


class MooncakeStore:
    """Mooncake Store over TCP: this node mounts `segment_bytes` of its memory into the pool (0: none)."""

    def __init__(self, config: RemoteTierConfig) -> None:
        # Mooncake's setup retries for about 90 s while its master is down, holding the GIL: a
        # master or metadata server that does not accept a connection is unavailable at once.
        for where in (config.master, urlsplit(config.metadata_server).netloc):
            _accepts_connections(where, config.timeout_s)
        # The address this node advertises to its peers (despite its name, not one it binds; see below).
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        warnings.warn(MOONCAKE_LISTENERS, RuntimeWarning, stacklevel=2)  # shown once per process
        # deferred: the pool's clients are an optional extra (pip install kvgate[pool])
        from mooncake.store import MooncakeDistributedStore

        self._store = MooncakeDistributedStore()
        code = self._store.setup(config.local_hostname, config.metadata_server, config.segment_bytes,
                                 config.local_buffer_bytes, "tcp", "", config.master)
        if code != 0:
            raise StoreUnavailable(f"mooncake: setup returned {code} (master {config.master}, "
                                   f"metadata {config.metadata_server})")

    def put(self, name: str, value: bytes) -> None:
        code = self._store.put(name, value)
        if code != 0 and not self._store.is_exist(name) == 1:
            raise StoreUnavailable(f"mooncake: put returned {code}")

    def get(self, name: str) -> Optional[bytes]:
        """The value, or None when the pool does not hold it. A get that returns nothing for a value the pool
        holds (its read lease ran out mid-transfer, LEASE_EXPIRED, on a busy node) is tried once more before
        the value counts as missing."""
        for _ in range(2):
            value = self._store.get(name)
            if value:
                return value
            found = self._store.is_exist(name)
            if found < 0:
                raise StoreUnavailable(f"mooncake: is_exist returned {found}")
            if found != 1:
                return None
        return None

    def exists(self, names: Sequence[str]) -> list[bool]:
        found = self._store.batch_is_exist(list(names))
        if any(code < 0 for code in found):
            raise StoreUnavailable(f"mooncake: batch_is_exist returned {found}")
        return [code == 1 for code in found]

    def remove(self, name: str) -> None:
        # force: a read lease (our own refused get) must not keep a bad value in the pool
        code = self._store.remove(name, True)
        if code != 0 and self._store.is_exist(name) == 1:
            raise StoreUnavailable(f"mooncake: remove returned {code}")

    def close(self) -> None:
        self._store.close()


def _accepts_connections(host_port: str, timeout_s: float) -> None:
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as error:
        raise StoreUnavailable(f"mooncake: {host_port} does not accept connections ({error})") from None


def open_store(config: RemoteTierConfig) -> RemoteStore:
    if config.backend == "redis":
        return RedisStore(config.url, config.timeout_s)
    return MooncakeStore(config)


class RemoteTier:
    name = "remote"
    accounted = False  # the store's own eviction manages the pool; what other nodes put is unknown here
    shared = True

    def __init__(self, config: RemoteTierConfig, fingerprint: Fingerprint,
                 store: Optional[RemoteStore] = None) -> None:
        self.config = config
        self.fingerprint = fingerprint.digest
        self.payload_nbytes = fingerprint.layout.block_nbytes
        self.stored_nbytes = integrity.HEADER_BYTES + self.payload_nbytes
        self._prefix = f"kvgate/{fingerprint.hex}/"
        self._store = store
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._connecting = False
        self._closed = False
        self.unavailable_calls = 0
        self.last_error: Optional[str] = None
        self._pool = ThreadPoolExecutor(config.read_workers, thread_name_prefix="kv-remote")
        if store is None:
            self._connect_in_background()

    def name_for(self, key: Key) -> str:
        return self._prefix + key.hex()

    # -- availability ----------------------------------------------------------
    #
    # Connecting happens on a background thread, never on a request's path: a client library
    # may block for long while its store is down (Mooncake's setup retries for about 90 s).
    # Until a connection stands, and for retry_s after a failure, every call is a counted miss.

    @property
    def available(self) -> bool:
        return self._store is not None and time.monotonic() >= self._down_until

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait for the first connection (at start, so the first requests can use the pool)."""
        deadline = time.monotonic() + timeout_s
        while self._store is None and self._connecting and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._store is not None

    def _connect_in_background(self) -> None:
        with self._lock:
            if self._connecting or self._store is not None or self._closed:
                return
            self._connecting = True
        threading.Thread(target=self._connect, name="kv-remote-connect", daemon=True).start()

    def _connect(self) -> None:
        """Try to connect every retry_s until it works (or the tier is closed)."""
        while not self._closed:
            try:
                store = open_store(self.config)
            except Exception as error:  # StoreUnavailable, or whatever the client library raised
                with self._lock:
                    self._down_until = time.monotonic() + self.config.retry_s
                    self.last_error = f"connecting: {error}"
                time.sleep(self.config.retry_s)
                continue
            with self._lock:
                self._store, self._connecting, self._down_until = store, False, 0.0
            return
        with self._lock:
            self._connecting = False

    def _connected(self) -> RemoteStore:
        """The store; StoreUnavailable while the tier is down or not connected (a connection is then started)."""
        with self._lock:
            store, down = self._store, time.monotonic() < self._down_until
        if down:
            raise StoreUnavailable(self.last_error or "unavailable")
        if store is None:
            raise StoreUnavailable("not connected to the pool yet")  # `_call` makes sure a connection is under way
        return store

    def _call(self, op, *args):
        store = None
        try:
            store = self._connected()
            return op(store, *args)
        except StoreUnavailable as error:
            with self._lock:
                self.unavailable_calls += 1
                if store is not None and self._store is store:  # this client failed: down for retry_s
                    self._down_until = time.monotonic() + self.config.retry_s
                    self.last_error = str(error)
                    # A client of a store that went away may never recover (Mooncake's keeps its old
                    # master): a fresh one is connected in the background. Calls still holding the
                    # old client finish with it; it is released with its last reference.
                    self._store = None
            self._connect_in_background()
            raise

    # -- the tier interface ----------------------------------------------------

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """Which keys the pool holds (all False while it is unavailable)."""
        if not keys:
            return []
        try:
            return self._call(lambda store: store.exists([self.name_for(k) for k in keys]))
        except StoreUnavailable:
            return [False] * len(keys)

    def stage(self, key: Key, block: torch.Tensor) -> tuple[str, bytes]:
        """The value to put (header + payload); nothing is in the pool until `commit`."""
        payload = cpu_bytes(block)
        if payload.nbytes != self.payload_nbytes:
            raise ValueError(f"remote tier: block has {payload.nbytes} bytes, layout says {self.payload_nbytes}")
        header = integrity.encode_header(self.fingerprint, key, payload.nbytes, integrity.checksum(payload))
        return self.name_for(key), header + payload.tobytes()

    def commit(self, staged: tuple[str, bytes]) -> None:
        """Put the value (visible only whole); raises StoreUnavailable, publishing nothing."""
        name, value = staged
        self._call(lambda store: store.put(name, value))

    def abort(self, staged: tuple[str, bytes]) -> None:
        """Nothing was put."""

    def view(self, key: Key) -> None:
        return None  # the bytes are in the pool

    def read_into(self, keys: Sequence[Key], outs: Sequence[torch.Tensor]) -> list[Optional[str]]:
        """Fetch and verify blocks in parallel; per key None (ok) or the reason it was refused."""
        return list(self._pool.map(self._read_one, keys, outs))

    def _read_one(self, key: Key, out: torch.Tensor) -> Optional[str]:
        try:
            value = self._call(lambda store: store.get(self.name_for(key)))
        except StoreUnavailable:
            return integrity.IO_ERROR
        if value is None:
            return integrity.MISSING
        if len(value) < self.stored_nbytes:
            return integrity.SHORT_READ
        reason, expected_sum = integrity.verify_header(value[: integrity.HEADER_BYTES], self.fingerprint, key,
                                                      self.payload_nbytes)
        if reason:
            return reason
        payload = memoryview(value)[integrity.HEADER_BYTES: self.stored_nbytes]
        if integrity.checksum(payload) != expected_sum:
            return integrity.BAD_CHECKSUM
        with warnings.catch_warnings():  # a read-only source is fine: it is only copied from
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8))
        out.copy_(source.view(out.dtype).view(out.shape))
        return None

    def delete(self, key: Key) -> None:
        """Remove a value that failed verification, so a whole one can be put again (never raises)."""
        try:
            self._call(lambda store: store.remove(self.name_for(key)))
        except StoreUnavailable:
            pass

    def discover(self) -> Iterator[Discovered]:
        return iter(())  # the pool is asked per prefix (`contains`), never listed

    def free_bytes(self) -> None:
        return None

    def drop_page_cache(self) -> None:
        """The pool has no page cache on this node."""

    def snapshot(self) -> dict:
        return {"available": self.available, "unavailable_calls": self.unavailable_calls,
                "last_error": self.last_error, "backend": self.config.backend}

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            if self._store is not None:
                try:
                    self._store.close()
                except Exception:
                    pass
                self._store = None
