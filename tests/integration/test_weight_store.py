"""Weights without a shared disk (--update-weight-transfer-mode object-store), against a real
nats-server with one user per role: the trainer stores a snapshot, the read-only engine identity
fetches it with every digest checked and cannot write or delete; a version is retired marker
first; and a built-in engine loads a nats-object:// snapshot, staged beside its running weights."""

from __future__ import annotations

import asyncio
import json

import httpx
import nats.js.errors
import pytest

from services.common.bus import Bus
from services.common.snapshot import is_complete
from services.weights.store import WeightStore, WeightStoreError, _b64, parse_uri
from services.engine.weights import ObjectWeights
from services.model.hf_io import load_model, save_model
from tests.conftest import EngineThread, connect_role, perturbed_model


@pytest.fixture(scope="module")
def server(role_server):
    return role_server


async def connect(server, role: str) -> Bus:
    return await connect_role(server, role)


@pytest.mark.parametrize("name", ["v\u00b2", "v\u0663", "v", "v1x", "1", "v" + "9" * 20])
def test_a_uri_whose_name_is_not_v_and_ascii_digits_is_not_a_version(name):
    assert parse_uri(f"nats-object://bucket/{name}") is None
    assert parse_uri("nats-object:///v1") is None and parse_uri("nats-object://bucket/v" + "9" * 19)[1] == 10**19 - 1


async def test_the_trainer_stores_the_engine_fetches_and_cannot_write(server, tiny_model_dir, tmp_path):
    admin, trainer, engine = [await connect(server, r) for r in ("admin", "trainer", "engine")]
    try:
        await admin.ensure_streams()
        snap = tmp_path / "v1"
        info = save_model(perturbed_model(tiny_model_dir, 1), snap, tiny_model_dir)
        store = WeightStore(trainer, chunk_size=64 * 1024)  # several chunks per weights file
        manifest = await store.upload(1, snap)
        assert manifest["sha256"] == info["sha256"] and "model.safetensors" in manifest["files"]
        assert parse_uri(store.uri(1)) == (store.bucket, 1)

        reader = WeightStore(engine)
        got = await reader.fetch(1, tmp_path / "fetched", expect_sha256=info["sha256"])
        assert is_complete(got)
        assert (got / "model.safetensors").read_bytes() == (snap / "model.safetensors").read_bytes()
        assert json.loads((got / "config.json").read_text()) == json.loads((snap / "config.json").read_text())
        with pytest.raises(WeightStoreError, match="differs from the announced"):
            await reader.fetch(1, tmp_path / "other", expect_sha256="0" * 64)
        with pytest.raises(WeightStoreError, match="not in the object store"):
            await reader.fetch(7, tmp_path / "none")

        # the engine's identity reads, nothing more: no put, no delete, no consumer on the bucket
        # (a refused call is never answered: each waits out a short timeout)
        js = engine.nc.jetstream(timeout=1.0)
        for subject in (f"$O.{store.bucket}.C.forged", f"$O.{store.bucket}.M.{_b64('v1/.complete')}"):
            with pytest.raises((nats.errors.Error, nats.js.errors.Error, TimeoutError)):
                await js.publish(subject, b"forged", timeout=1)
        with pytest.raises((nats.errors.Error, nats.js.errors.Error, TimeoutError)):
            await js.purge_stream(store.stream)
        assert (await reader.manifest(1))["sha256"] == info["sha256"]
        with pytest.raises((nats.errors.Error, nats.js.errors.Error, TimeoutError)):
            await js.add_consumer(store.stream, durable_name="spy")

        await store.upload(2, snap)
        await store.retire(1)
        assert await reader.manifest(1) is None and await reader.manifest(2) is not None
        with pytest.raises(WeightStoreError):
            await reader.fetch(1, tmp_path / "retired")
    finally:
        for b in (admin, trainer, engine):
            await b.close()


async def test_an_incomplete_version_is_never_fetched(server, tiny_model_dir, tmp_path):
    admin, trainer, engine = [await connect(server, r) for r in ("admin", "trainer", "engine")]
    try:
        await admin.ensure_streams()
        snap = tmp_path / "v3"
        save_model(load_model(tiny_model_dir), snap, tiny_model_dir)
        obs = await trainer.js.object_store(trainer.subjects.weights_bucket)
        await obs.put("v3/model.safetensors", (snap / "model.safetensors").read_bytes())  # no marker: a crash mid-upload
        reader = WeightStore(engine)
        assert await reader.manifest(3) is None
        with pytest.raises(WeightStoreError, match="incomplete"):
            await reader.fetch(3, tmp_path / "fetched")
        # a version retired while it is fetched: the fetch fails and leaves no partial copy behind
        await WeightStore(trainer).upload(4, snap)
        await obs.delete("v4/model.safetensors")
        with pytest.raises(WeightStoreError, match="missing"):
            await reader.fetch(4, tmp_path / "v4")
        assert not (tmp_path / "v4.part").exists() and not (tmp_path / "v4").exists()
    finally:
        for b in (admin, trainer, engine):
            await b.close()


async def test_the_engine_stages_an_object_store_snapshot_and_swaps_it_in(server, tiny_model_dir, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    srv, run_id, pw = server
    admin, trainer = await connect(server, "admin"), await connect(server, "trainer")
    try:
        await admin.ensure_streams()
        snap = tmp_path / "v5"
        save_model(perturbed_model(tiny_model_dir, 5), snap, tiny_model_dir)
        store = WeightStore(trainer)
        await store.upload(5, snap)
        monkeypatch.setenv("ASYNCRL_NATS_USER", "engine")
        monkeypatch.setenv("ASYNCRL_NATS_PASSWORD", pw["engine"])
        weights = ObjectWeights(srv.url, run_id, tmp_path / "cache")
        with EngineThread(tiny_model_dir, weights=weights) as eng:
            prompt = {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
            async with httpx.AsyncClient(base_url=eng.url, timeout=60) as http:
                before = (await http.post("/generate", json=prompt)).json()["output_ids"]
                r = await http.post("/stage_weights", json={"model_path": store.uri(5), "weight_version": "5"})
                assert r.status_code == 200 and r.json()["success"], r.text
                assert eng.scheduler.weight_version == "0"  # staged beside, still serving the old weights
                assert (await http.post("/generate", json=prompt)).json()["output_ids"] == before
                await http.post("/pause_generation", json={"mode": "retract"})
                r = await http.post("/update_weights_from_disk",
                                    json={"model_path": store.uri(5), "weight_version": "5"})  # fmt: skip
                await http.post("/continue_generation")
                assert r.status_code == 200 and r.json()["staged"] is True, r.text
                after = (await http.post("/generate", json=prompt)).json()
                assert after["meta_info"]["weight_version"] == "5"
                forged = await http.post("/update_weights_from_disk",
                                         json={"model_path": "nats-object://OTHER_run/v5", "weight_version": "6"})
                assert forged.status_code == 400 and "this run's weights bucket" in forged.text
        # the swapped-in weights are exactly the snapshot's: the same greedy output as a fresh load
        with EngineThread(snap) as fresh:
            async with httpx.AsyncClient(base_url=fresh.url, timeout=60) as http:
                expected = (await http.post("/generate", json=prompt)).json()["output_ids"]
        assert after["output_ids"] == expected
    finally:
        for b in (admin, trainer):
            await b.close()


async def test_an_adapter_version_travels_by_the_object_store_to_the_engine(server, tiny_model_dir, tmp_path,
                                                                            monkeypatch):  # fmt: skip
    """Multi-LoRA in object-store mode: the trainer uploads an adapter version, weight-sync's
    check finds it complete, the built-in engine fetches it for /load_lora_adapter (digest checked)
    and serves it; a retired version, a forged URI and another run's bucket never load."""
    import torch

    from asyncrl_proto import AdapterPublished
    from services.weights.store import adapter_uri, parse_adapter_uri
    from services.model.lora import ATTENTION, LoraSpec, MultiLora, save_adapter
    from services.weightsync.adapters import AdapterSync

    srv, run_id, pw = server
    admin, trainer, sync = [await connect(server, r) for r in ("admin", "trainer", "weight-sync")]
    try:
        await admin.ensure_streams()
        lora = MultiLora(load_model(tiny_model_dir), n_slots=1, max_rank=8)
        lora.init_slot(0, LoraSpec(rank=8, alpha=16.0, target_modules=ATTENTION), seed=0)
        with torch.no_grad():
            for b in lora.B.values():
                b[0].normal_(0, 0.5)
        rid = "ab" * 16
        local = save_adapter(lora, 0, tmp_path / "v3")
        store = WeightStore(trainer)
        await store.upload_adapter("rev", rid, 3, local)
        # the trainer reads the engines' version of an adapter (what it retains): allowed, and prompt
        assert await asyncio.wait_for(trainer.kv_get("adapter_live.rev"), 5) is None
        uri = adapter_uri(store.bucket, "rev", rid, 3)
        assert parse_adapter_uri(uri) == (store.bucket, "rev", rid, 3)
        assert parse_adapter_uri(uri.replace("/rev/", "/../")) is None and parse_adapter_uri(uri + "/x") is None

        checker = AdapterSync(sync, client=None, run_dir=str(tmp_path / "run"), store=WeightStore(sync))
        pub = AdapterPublished(name="rev", registration_id=rid, version=3, uri=uri)
        assert await checker.problem(pub) is None
        assert "not the run's" in await checker.problem(AdapterPublished(name="rev", registration_id=rid, version=3,
                                                                          uri=str(local)))  # fmt: skip
        assert "no complete version" in await checker.problem(AdapterPublished(
            name="rev", registration_id=rid, version=4, uri=adapter_uri(store.bucket, "rev", rid, 4)))  # fmt: skip

        monkeypatch.setenv("ASYNCRL_NATS_USER", "engine")
        monkeypatch.setenv("ASYNCRL_NATS_PASSWORD", pw["engine"])
        weights = ObjectWeights(srv.url, run_id, tmp_path / "cache")
        prompt = {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        with EngineThread(tiny_model_dir, weights=weights, max_loras=2) as eng:
            async with httpx.AsyncClient(base_url=eng.url, timeout=60) as http:
                base = (await http.post("/generate", json=prompt)).json()["output_ids"]
                r = await http.post("/load_lora_adapter", json={"lora_name": "rev-v3", "lora_path": uri})
                assert r.status_code == 200 and r.json()["success"], r.text
                tuned = (await http.post("/generate", json={**prompt, "lora_path": "rev-v3"})).json()["output_ids"]
                assert tuned != base  # the fetched adapter is the one in use
                await store.retire_adapter("rev", rid, 3)
                gone = await http.post("/load_lora_adapter", json={
                    "lora_name": "rev-v5", "lora_path": adapter_uri(store.bucket, "rev", rid, 5)})  # fmt: skip
                assert gone.status_code == 400 and "Failed to load LoRA adapter" in gone.text
                other = await http.post("/load_lora_adapter", json={
                    "lora_name": "x", "lora_path": adapter_uri("OTHER_run", "rev", rid, 3)})  # fmt: skip
                assert other.status_code == 400 and "this run's weights bucket" in other.text
        # what the engine served is the uploaded adapter: the same output as from the local directory
        with EngineThread(tiny_model_dir, max_loras=2) as ref:
            async with httpx.AsyncClient(base_url=ref.url, timeout=60) as http:
                await http.post("/load_lora_adapter", json={"lora_name": "rev-v3", "lora_path": str(local)})
                assert (await http.post("/generate", json={**prompt, "lora_path": "rev-v3"})).json()["output_ids"] == tuned
    finally:
        for b in (admin, trainer, sync):
            await b.close()
