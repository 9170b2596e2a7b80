"""Weight snapshots in the run's NATS JetStream Object Store bucket (--update-weight-transfer-mode
object-store): engines and a restarted trainer on any host fetch them, no shared disk needed.

Layout: version N is the objects `v<N>/<file>` (model.safetensors, config.json, the tokenizer
files), each chunked and SHA-256-digested by the object store, and `v<N>/.complete` last: JSON
{"sha256": <the weights file's digest>, "files": {name: size}}. A version without its marker is
incomplete and never read; retiring a version deletes its marker first, then its files.

Roles (services.common.natsauth): the trainer writes and retires; weight-sync, the built-in engine
and the trainer read. Readers fetch meta and chunks by direct get (one message per request, no
consumer): a reader's credentials cannot create a consumer, write or delete.

A snapshot's URI on weights.published is `nats-object://<bucket>/v<N>`.

Multi-LoRA adapter versions live in the same bucket under `adapters/<name>/<registration>/v<N>/`
(adapter_config.json, adapter_model.safetensors, the marker last), announced on weights.adapters
as `nats-object://<bucket>/adapters/<name>/<registration>/v<N>`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

from services.common.snapshot import COMPLETE_MARKER, numbered

log = logging.getLogger(__name__)

SCHEME = "nats-object://"
DEFAULT_CHUNK = 128 * 1024
MODEL_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
_ADAPTER_KEY = re.compile(r"adapters/([A-Za-z0-9._-]{1,128})/([0-9a-f]{32})/v(\d{1,18})")


class WeightStoreError(RuntimeError):
    """A version that is missing, incomplete or whose bytes are not the ones announced."""


def parse_uri(uri: str) -> tuple[str, int] | None:
    """(bucket, version) of a `nats-object://<bucket>/v<N>` URI; None for anything else."""
    bucket, _, name = uri[len(SCHEME) :].partition("/")
    if not uri.startswith(SCHEME) or not bucket or not (m := re.fullmatch(r"v([0-9]{1,19})", name)):
        return None
    return bucket, int(m[1])


def adapter_key(name: str, registration_id: str, version: int) -> str:
    """Where an adapter version's objects live in the bucket (a "directory" of object names)."""
    return f"adapters/{name}/{registration_id}/v{version}"


def adapter_uri(bucket: str, name: str, registration_id: str, version: int) -> str:
    return f"{SCHEME}{bucket}/{adapter_key(name, registration_id, version)}"


def parse_adapter_uri(uri: str) -> tuple[str, str, str, int] | None:
    """(bucket, name, registration, version) of a `nats-object://<bucket>/adapters/<name>/<registration>/v<N>`
    URI; None for anything else (a name of `.` or `..` included)."""
    bucket, _, key = uri[len(SCHEME) :].partition("/")
    m = _ADAPTER_KEY.fullmatch(key)
    if not uri.startswith(SCHEME) or not bucket or m is None or m.group(1) in (".", ".."):
        return None
    return bucket, m.group(1), m.group(2), int(m.group(3))


def _b64(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


class WeightStore:
    """One run's weight bucket, through a connected Bus (its role decides what it may do)."""

    def __init__(self, bus, chunk_size: int = DEFAULT_CHUNK):
        self.bus = bus
        self.bucket = bus.subjects.weights_bucket
        self.stream = f"OBJ_{self.bucket}"
        # a chunk and its headers must fit one message: at most half the server's max_payload
        max_payload = getattr(bus.nc, "max_payload", 0) or 1024 * 1024
        self.chunk_size = max(4096, min(chunk_size, max_payload // 2))

    def uri(self, version: int) -> str:
        return f"{SCHEME}{self.bucket}/v{version}"

    # ---- writing (trainer) -------------------------------------------------------------------
    async def upload(self, version: int, snapshot_dir: str | Path) -> dict:
        """Put the complete local snapshot `snapshot_dir` as version `version`, its marker last.
        Returns the marker's content. Idempotent: a re-upload (after a crash) replaces each file."""
        return await self._upload(f"v{version}", Path(snapshot_dir), MODEL_FILE)

    async def upload_adapter(self, name: str, registration_id: str, version: int, adapter_dir: str | Path) -> dict:
        """Put a complete local adapter directory (PEFT) as that adapter version, its marker last."""
        return await self._upload(adapter_key(name, registration_id, version), Path(adapter_dir), ADAPTER_FILE)

    async def _upload(self, key: str, src: Path, weights_file: str) -> dict:
        try:  # a model snapshot's marker holds its weights file's digest; an adapter's is empty
            sha = json.loads((src / COMPLETE_MARKER).read_text()).get("sha256", "")
        except (ValueError, AttributeError):
            sha = ""
        if not sha:
            sha = await asyncio.to_thread(lambda: hashlib.sha256((src / weights_file).read_bytes()).hexdigest())
        await self.bus.objects.delete(self.bucket, f"{key}/{COMPLETE_MARKER}")  # a stale marker first
        files = {}
        for f in sorted(p for p in src.iterdir() if p.is_file() and p.name != COMPLETE_MARKER):
            with f.open("rb") as fh:
                await self.bus.objects.put(self.bucket, f"{key}/{f.name}", fh, self.chunk_size)
            files[f.name] = f.stat().st_size
        manifest = {"sha256": sha, "files": files}
        await self.bus.objects.put(self.bucket, f"{key}/{COMPLETE_MARKER}", json.dumps(manifest).encode(),
                                   self.chunk_size)  # fmt: skip
        return manifest

    async def retire(self, version: int) -> None:
        """Delete a version: its marker first (a reader meanwhile finds it incomplete), then its files."""
        await self._retire(f"v{version}")

    async def retire_adapter(self, name: str, registration_id: str, version: int) -> None:
        await self._retire(adapter_key(name, registration_id, version))

    async def _retire(self, key: str) -> None:
        manifest = await self._manifest(key)
        await self.bus.objects.delete(self.bucket, f"{key}/{COMPLETE_MARKER}")
        for name in (manifest or {}).get("files", {}):
            await self.bus.objects.delete(self.bucket, f"{key}/{name}")

    async def stored_versions(self) -> list[int]:
        """The complete versions in the bucket (listing needs the admin role: `asyncrl audit`)."""
        return [k for k, _ in numbered(await self.bus.objects.names(self.bucket), "v", "/" + COMPLETE_MARKER)]

    # ---- reading (weight-sync, engines, a restarted trainer) ----------------------------------
    async def _info(self, name: str) -> dict | None:
        msg = await self.bus.get_last(self.stream, f"$O.{self.bucket}.M.{_b64(name)}", direct=True)
        if msg is None or not msg.data:
            return None
        try:
            info = json.loads(msg.data)
        except ValueError:
            return None
        return None if not isinstance(info, dict) or info.get("deleted") or not info.get("nuid") else info

    async def manifest(self, version: int) -> dict | None:
        """The marker of a complete version; None when the version is missing or incomplete."""
        return await self._manifest(f"v{version}")

    async def adapter_manifest(self, name: str, registration_id: str, version: int) -> dict | None:
        return await self._manifest(adapter_key(name, registration_id, version))

    async def _manifest(self, key: str) -> dict | None:
        info = await self._info(f"{key}/{COMPLETE_MARKER}")
        if info is None:
            return None
        try:
            manifest = json.loads(await self._read_object(info))
        except ValueError:
            return None
        return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None

    async def _read_object(self, info: dict, out=None) -> bytes:
        """An object's bytes (or written to `out`), chunk by chunk, checked against its digest."""
        size, subject = int(info.get("size") or 0), f"$O.{self.bucket}.C.{info['nuid']}"
        h, got, seq, parts = hashlib.sha256(), 0, 1, []
        while got < size:
            msg = await self.bus.get_next(self.stream, subject, seq)
            if msg is None or msg.data is None:
                raise WeightStoreError(f"{info.get('name')}: a chunk is missing after {got} of {size} bytes")
            h.update(msg.data)
            got += len(msg.data)
            if out is None:
                parts.append(msg.data)
            else:
                await asyncio.to_thread(out.write, msg.data)
            seq = msg.seq + 1
        digest = "SHA-256=" + base64.urlsafe_b64encode(h.digest()).decode()
        if got != size or digest.rstrip("=") != str(info.get("digest", "")).rstrip("="):
            raise WeightStoreError(f"{info.get('name')}: its bytes do not match the object's digest")
        return b"".join(parts)

    async def fetch(self, version: int, dest: str | Path, expect_sha256: str | None = None) -> Path:
        """Download a complete version into the directory `dest` (replaced), with a local
        `.complete` marker last, so disk loaders take it as a complete snapshot. The weights
        file's SHA-256 must be the manifest's (and `expect_sha256`, when given)."""
        return await self._fetch(f"v{version}", f"weights v{version}", MODEL_FILE, dest, expect_sha256)

    async def fetch_adapter(self, name: str, registration_id: str, version: int, dest: str | Path) -> Path:
        """Download a complete adapter version into `dest`, as fetch (its adapter_model.safetensors checked)."""
        return await self._fetch(adapter_key(name, registration_id, version), f"adapter {name} v{version}",
                                 ADAPTER_FILE, dest)  # fmt: skip

    async def _fetch(self, key: str, what: str, weights_file: str, dest, expect_sha256: str | None = None) -> Path:
        manifest = await self._manifest(key)
        if manifest is None:
            raise WeightStoreError(f"{what} is not in the object store (or incomplete)")
        if expect_sha256 is not None and manifest.get("sha256") != expect_sha256:
            raise WeightStoreError(f"{what}: the stored digest differs from the announced one")
        out = Path(dest)
        tmp = out.with_name(out.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for name in manifest["files"]:
                if not isinstance(name, str) or name != Path(name).name or name in ("", ".", "..", COMPLETE_MARKER):
                    raise WeightStoreError(f"{what}: the manifest names a file {name!r:.80}")
                info = await self._info(f"{key}/{name}")
                if info is None:
                    raise WeightStoreError(f"{what}: {name} is missing from the object store")
                with (tmp / name).open("wb") as fh:
                    await self._read_object(info, fh)
            weights = tmp / weights_file
            if not weights.exists():
                raise WeightStoreError(f"{what}: the manifest has no {weights_file}")
            digest = await asyncio.to_thread(lambda: hashlib.sha256(weights.read_bytes()).hexdigest())
            if digest != manifest.get("sha256"):
                raise WeightStoreError(f"{what}: the weights file's digest differs from the manifest's")
            (tmp / COMPLETE_MARKER).write_text(json.dumps({"sha256": digest}))
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
            return out
        finally:  # a fetch cut off (the version retired meanwhile, a lost connection) leaves nothing
            shutil.rmtree(tmp, ignore_errors=True)
