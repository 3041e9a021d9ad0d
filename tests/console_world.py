"""A live server with two tenants' training runs and an operator, for the console's tests.

Alice trains a run, saves it twice, and starts a second run from her first checkpoint (a lineage
of two runs); Bob trains one run of his own. ``ops`` is named by ``--operator``. Real keys (no
``--dev``), real SDK calls over HTTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tinker
from tinker import types

from opentinker.server.auth import create_key
from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL


def datum(toks: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)},
    )


def start_world(data_dir: Path) -> tuple[LocalServer, dict[str, Any]]:
    keys = {t: create_key(data_dir, t) for t in ("alice", "bob", "ops")}
    srv = LocalServer(
        ["--base-model", TEST_MODEL, "--operator", "ops", "--poll-timeout", "5"], data_dir=data_dir
    )
    srv.start()
    world: dict[str, Any] = {"keys": keys}
    try:
        for tenant, steps in (("alice", 3), ("bob", 1)):
            service = tinker.ServiceClient(base_url=srv.base_url, api_key=keys[tenant])
            tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0).result()
            for i in range(steps):
                tc.forward_backward([datum(list(range(3 + i, 15 + i)))], "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            path = tc.save_state(f"{tenant}-s{steps}").result().path
            world[tenant] = {"model_id": tc.model_id, "path": path, "service": service}
        alice = world["alice"]["service"]
        sampler = tinker.ServiceClient(base_url=srv.base_url, api_key=keys["alice"])
        tc = sampler.create_training_client_from_state_with_optimizer(world["alice"]["path"]).result()
        snap = tc.save_weights_and_get_sampling_client().result()
        snap.sample(
            types.ModelInput.from_ints([3, 4, 5]), 1, types.SamplingParams(max_tokens=4, seed=0)
        ).result()
        tc.forward_backward([datum(list(range(20, 30)))], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        child = tc.save_state("alice-child").result().path
        world["alice_child"] = {"model_id": tc.model_id, "path": child}
        del alice
    except BaseException:
        srv.stop()
        raise
    return srv, world
