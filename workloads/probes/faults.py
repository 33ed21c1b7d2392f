"""The client side of fault injection: it drives the faults `cache_impl.cache.faults` defines into a running
server, through the admin routes, and the admin client it acts through.

- Stored blocks: the disk block files a prompt uses (asked of /admin/cache/locate, so a test or a
  soak damages exactly the blocks a request is about to load) are damaged in place
  (`cache_impl.cache.faults.damage_block`) and the upper tiers evicted, so the next request meets them.
- Disk I/O: armed in the server's disk tier through /admin/faults (`AdminClient.arm`, `clear`).
- `kill -9` of a server and its restart with the same command line, so it
  re-indexes the same directories.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from prometheus_client.parser import text_string_to_metric_families

from cache_impl.cache.faults import damage_block
from cache_impl.server.auth import ADMIN_TOKEN_ENV, ADMIN_TOKEN_HEADER
from workloads.traffic.processes import die_with_parent
from workloads.traffic.target_json import (
    BadResponse,
    json_object,
    optional_count,
    optional_text,
    required_list,
    required_text,
)

# -- the server's admin routes ---------------------------------------------------------


class AdminError(RuntimeError):
    """An admin route answered with an error."""


@dataclass
class AdminClient:
    """The embedded server's admin routes and the figures of its /metrics.

    The admin routes need the server's admin token (sent in the X-Kvgate-Admin-Token header):
    by default the one in $KVGATE_ADMIN_TOKEN, where `kvgate run` puts the token it generated
    for its embedded servers. /health and /metrics need none.
    """

    server_root: str                 # http://127.0.0.1:PORT (no /v1)
    api_key: Optional[str] = field(default=None, repr=False)  # the server's API key (Bearer), if any
    timeout_s: float = 120.0
    token: Optional[str] = field(default_factory=lambda: os.environ.get(ADMIN_TOKEN_ENV) or None, repr=False)

    def _call(self, method: str, path: str, body: Optional[dict] = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server_root + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        if self.token and path.startswith("/admin/"):
            request.add_header(ADMIN_TOKEN_HEADER, self.token)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            raise AdminError(f"{method} {path}: HTTP {error.code}: {error.read().decode(errors='replace')}") from None
        if path == "/metrics":
            return payload.decode(errors="replace")
        try:
            return json_object(json.loads(payload), f"{method} {path}")
        except ValueError as error:   # not JSON, or not an object (BadResponse)
            raise AdminError(f"{method} {path}: expected a JSON object, found {payload[:120]!r}"
                             if not isinstance(error, BadResponse) else str(error)) from None

    def locate(self, prompt: Optional[str] = None, messages: Optional[list] = None,
               token_ids: Optional[list[int]] = None) -> list[dict]:
        """The prompt's full blocks in order: key, tiers holding it, and its disk file (each field type-checked:
        AdminError naming the field otherwise). The prompt as text, chat messages, or its token ids."""
        body: dict[str, object]
        if token_ids is not None:
            body = {"prompt_token_ids": list(token_ids)}
        else:
            body = {"prompt": prompt} if prompt is not None else {"messages": list(messages or [])}
        answer = self._call("POST", "/admin/cache/locate", body)
        try:
            return [_located_block(block, f"POST /admin/cache/locate: blocks[{i}]")
                    for i, block in enumerate(required_list(answer, "blocks", "POST /admin/cache/locate: blocks"))]
        except BadResponse as bad:
            raise AdminError(str(bad)) from None

    def evict(self, tiers=("device", "host")) -> dict:
        return self._call("POST", "/admin/cache/evict", {"tiers": list(tiers)})

    def flush(self) -> dict:
        return self._call("POST", "/admin/cache/flush", {})

    def drop_page_cache(self) -> dict:
        """Drop the disk tier's files from the page cache, so the next disk load really reads the device."""
        return self._call("POST", "/admin/cache/drop-page-cache", {})

    def arm(self, kind: str, duration_s: Optional[float] = None, delay_ms: Optional[float] = None) -> dict:
        body = {"kind": kind, "duration_s": duration_s, "delay_ms": delay_ms}
        return self._call("POST", "/admin/faults", {k: v for k, v in body.items() if v is not None})

    def clear(self) -> dict:
        return self._call("DELETE", "/admin/faults")

    def health(self) -> dict:
        return self._call("GET", "/health")

    def metrics(self) -> dict[tuple, float]:
        """Every sample of /metrics as {(name, (label, value), ...): value} (AdminError when it is not Prometheus
        text)."""
        samples = {}
        try:
            for family in text_string_to_metric_families(self._call("GET", "/metrics")):
                for sample in family.samples:
                    samples[(sample.name, *sorted(sample.labels.items()))] = sample.value
        except (ValueError, TypeError, IndexError, KeyError) as error:
            raise AdminError(f"GET /metrics: expected Prometheus text exposition, found a line it cannot parse "
                             f"({type(error).__name__}: {error})") from None
        return samples


def _located_block(block: object, field: str) -> dict:
    """One block of /admin/cache/locate's answer, its fields type-checked."""
    block = json_object(block, field)
    tiers = required_list(block, "tiers", f"{field}.tiers")
    for i, tier in enumerate(tiers):
        if not isinstance(tier, str):
            raise BadResponse(f"{field}.tiers[{i}]", "a tier name (a string)", tier)
    index = optional_count(block, "index", f"{field}.index")
    return {**block, "key": required_text(block, "key", f"{field}.key"), "tiers": tiers,
            "path": optional_text(block, "path", f"{field}.path"), "index": index}


def counter(samples: dict[tuple, float], name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels` (0 when there is none)."""
    return sum(_matching(samples, name, labels))


def gauge(samples: dict[tuple, float], name: str, **labels: str) -> Optional[float]:
    """As `counter`, but None when /metrics has no such sample (a figure the server does not give)."""
    found = _matching(samples, name, labels)
    return sum(found) if found else None


def _matching(samples: dict[tuple, float], name: str, labels: dict) -> list[float]:
    wanted = set(labels.items())
    return [v for (n, *pairs), v in samples.items() if n == name and wanted <= set(pairs)]


def per_tier(samples: dict[tuple, float], name: str) -> dict[str, float]:
    """A per-tier metric as {tier: value}."""
    return {dict(pairs)["tier"]: v for (n, *pairs), v in samples.items() if n == name and "tier" in dict(pairs)}


def detection_counts(samples: dict[tuple, float]) -> dict[str, float]:
    """What the cache counted of damaged or unreadable blocks, and of injected I/O faults."""
    return {
        "corrupt_blocks": counter(samples, "kvgate_cache_corrupt_blocks_total"),
        "read_errors": counter(samples, "kvgate_cache_read_errors_total"),
        "write_errors": counter(samples, "kvgate_cache_write_errors_total"),
        "faults_injected": counter(samples, "kvgate_faults_injected_total"),
        "disk_hits": counter(samples, "kvgate_cache_hits_total", tier="disk"),
    }


def damage_prompt_blocks(admin: AdminClient, kind: str, prompt: Optional[str] = None,
                         messages: Optional[list] = None, block: int = -1,
                         token_ids: Optional[list[int]] = None) -> dict:
    """Damage one stored disk block of a prompt (default: the last of its leading blocks on disk), then evict
    the upper tiers so the next request for the prompt must load it from disk.

    Only the leading run of blocks that the tiers below the host hold is a load's to read: a prefix load
    stops at the first block it finds nowhere, so a damaged block past such a gap would be recomputed,
    never read, and the fault would go unseen. (In a long soak the disk tier evicts by LRU, and a probe
    served from the host never touches its disk blocks: they go first.)"""
    admin.flush()
    located = admin.locate(prompt, messages, token_ids)
    loadable = _loadable_prefix(located)
    blocks = [b for b in loadable if "disk" in b["tiers"]]
    if not blocks:
        raise AdminError("the prompt has no block on the disk tier to damage (none in its leading blocks "
                         "that a load from the lower tiers would read)")
    victim = blocks[block]
    donors = [b for b in blocks if b is not victim]
    donor = Path(donors[0]["path"]) if kind == "swap" and donors else None
    if kind == "swap" and donor is None:
        raise AdminError("swap: the prompt has no second disk block to take bytes from")
    done = damage_block(kind, Path(victim["path"]), donor)
    evict_until_on_disk_only(admin, victim["key"], prompt, messages, token_ids=token_ids)
    return {**done, "block_index": victim["index"], "key": victim["key"], "prompt_blocks": len(located),
            "loadable_blocks": len(loadable), "inode": _inode(Path(victim["path"]))}


def _inode(path: Path) -> Optional[int]:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def damage_in_place(detail: dict) -> bool:
    """Whether the block file `damage_prompt_blocks` damaged (its `detail`) is still that damaged file: a store
    of the same block publishes a whole copy by an atomic rename (a new file), and a deleted block comes back."""
    return _inode(Path(detail["path"])) == detail["inode"]


def _loadable_prefix(blocks: list[dict]) -> list[dict]:
    """The leading blocks that a load would still find once the device and host tiers are emptied."""
    loadable = []
    for block in blocks:
        if not [tier for tier in block["tiers"] if tier not in ("device", "host")]:
            break
        loadable.append(block)
    return loadable


def evict_until_on_disk_only(admin: AdminClient, key: str, prompt: Optional[str] = None,
                             messages: Optional[list] = None, timeout_s: float = 5.0,
                             token_ids: Optional[list[int]] = None) -> None:
    """Evict the upper tiers until block `key` is held by the disk alone. A block that a request in flight
    has pinned (a load under way) is not evicted, and the next request would then be served its
    undamaged upper-tier copy; so the eviction is repeated until the pin is gone (AdminError after
    `timeout_s`, naming the tiers that still hold it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        admin.evict(("device", "host"))
        held = next((b["tiers"] for b in admin.locate(prompt, messages, token_ids) if b["key"] == key), ["disk"])
        upper = [tier for tier in held if tier in ("device", "host")]   # a pool copy is read after the disk
        if not upper:
            return
        if time.monotonic() >= deadline:
            raise AdminError(f"block {key} stayed in {', '.join(upper)} for {timeout_s:g} s of evictions "
                             "(pinned by requests in flight)")
        time.sleep(0.05)


@dataclass
class CacheAdmin:
    """kvgate's admin routes over a candidate's cache (`kvgate serve --admin`'s, or the sidecar of kvgate's
    connector inside vLLM), with what goes with them: what empties the engine's own device cache above that
    cache, so that the next request loads from the cache (nothing for kvgate serve, whose device tier the admin
    routes evict; vLLM's prefix cache for the connector), and how a chat prompt becomes the token ids the
    routes locate (None: the routes apply the chat template themselves, as kvgate serve's do). G2's cold reads
    and G4's faults act through it."""

    admin: AdminClient
    clear_engine: Callable[[], object] = lambda: None
    chat_token_ids: Optional[Callable[[list], list[int]]] = None

    def token_ids(self, messages: list) -> Optional[list[int]]:
        return self.chat_token_ids(messages) if self.chat_token_ids is not None else None


# -- processes ----------------------------------------------------------------------------------


def kill_and_restart(pid: int, log_path: Path, wait_s: float = 30.0,
                     while_down: Optional[Callable[[], None]] = None) -> subprocess.Popen:
    """SIGKILL a server and start it again with the same command line, working directory and
    environment (it re-indexes its directories at start); the new process logs to `log_path`.
    `while_down` runs once the old process is gone and before the new one starts (to look at or
    damage what the killed process left)."""
    proc = Path(f"/proc/{pid}")
    command = [part.decode() for part in (proc / "cmdline").read_bytes().split(b"\0") if part]
    cwd = os.readlink(proc / "cwd")
    env = dict(item.decode().split("=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if while_down is not None:
        while_down()
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
