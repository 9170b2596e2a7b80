"""--use-ray's configuration rules and the launcher's command for a placed child (no Ray needed)."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.common.config_load import resolve_config
from services.raycluster import with_ray_defaults


def test_use_ray_defaults_to_the_object_store():
    c = with_ray_defaults(resolve_config({"use_ray": True, "trainer_num_ranks": 2}, environ={}))
    assert c.async_.update_weight_transfer_mode == "object-store"
    assert with_ray_defaults(resolve_config({}, environ={})).async_.update_weight_transfer_mode == "disk"


def test_use_ray_refuses_disk_weights():
    with pytest.raises(ConfigError, match="--use-ray places engines on nodes that do not see the trainer's disk"):
        resolve_config({"use_ray": True, "update_weight_transfer_mode": "disk"}, environ={})
    for mode in ("object-store", "distributed"):  # a bucket, or a broadcast from the trainer's node
        resolve_config({"use_ray": True, "update_weight_transfer_mode": mode}, environ={})
