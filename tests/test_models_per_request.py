"""Requests name a model: where it fits, how fast it runs, and what happens with an unknown one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from envs.cloud_route import CloudRouteEnv
from envs.serving import load_models, load_serving, place
from tests.tinybundle import write_tiny_bundle
from xroute.bundle import load_bundle
from xroute.errors import ConfigError

MODELS = ["llama-2-7b", "llama-2-13b", "llama-2-70b"]


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bundle(tmp_path_factory.mktemp("multi"), n_requests=300, models=MODELS, big_instances=True)


def test_placement_follows_the_documented_rules() -> None:
    serving, models = load_serving("serving.yaml"), load_models("models.yaml")
    b = load_bundle()
    cat = b.catalog()
    pl = place(cat, [9] * len(cat), serving, models)
    k7, k13, k70 = (pl.models.index(m) for m in MODELS)
    for i, o in enumerate(cat):
        acc = serving.accelerators[o.accelerator]
        # the reference model: serving.yaml unchanged, one GPU per replica
        assert pl.fits[k7, i] and pl.gpus[k7, i] == 1 and pl.conc[k7, i] == acc.max_concurrency
        assert pl.tpot_s[k7, i] == acc.tpot_ms / 1000.0 and pl.prefill_tok_s[k7, i] == acc.prefill_tok_s
        # 70B (138 GB of weights) needs several 80 GB GPUs of one instance, or 4+ of 40 GB
        mem = acc.memory_gb * o.accelerator_count
        assert pl.fits[k70, i] == (0.9 * mem > 138.0 + 0.35), o.offering_id
        if pl.fits[k13, i] and pl.gpus[k13, i] == 1:  # same GPU, bigger model: slower, fewer slots
            assert pl.tpot_s[k13, i] > pl.tpot_s[k7, i] and pl.conc[k13, i] <= pl.conc[k7, i]
    a100x8 = next(i for i, o in enumerate(cat) if o.accelerator == "A100-80GB" and o.accelerator_count == 8)
    assert pl.gpus[k70, a100x8] == 2 and pl.replicas[k70, a100x8] == 9 // 2
    # 9.1 ms x (137.96 / 13.48) / (2 x 0.74): the bandwidth rule with one TP doubling
    assert pl.tpot_s[k70, a100x8] * 1000 == pytest.approx(9.1 * 137.96 / 13.48 / (2 * 0.74), rel=1e-9)
    t4 = next(i for i, o in enumerate(cat) if o.accelerator == "T4")
    assert not pl.fits[k13, t4] and not pl.fits[k70, t4]


def test_an_offering_that_cannot_hold_the_model_is_masked_and_service_depends_on_the_model(multi: Path) -> None:
    env = CloudRouteEnv(str(multi), episode_requests=None, max_offerings=16)
    big = [env.offering_index(f"aws:us-east-1:p4de.24xlarge:{m}") for m in ("on_demand", "spot")]
    t = env.arrival[0]
    masks, service = {}, {}
    for m in MODELS:
        masks[m] = env.set_live(t, "aws:us-east-1", 1000, 200, 5000.0, 200.0, model=m).copy()
        service[m] = env.c_service.copy()
    assert masks["llama-2-7b"].sum() > masks["llama-2-70b"].sum()
    assert set(np.flatnonzero(masks["llama-2-70b"])) <= set(big)  # only the 8 x 80 GB instance holds 70B
    od = big[0]
    assert service["llama-2-70b"][od] > service["llama-2-13b"][od] > service["llama-2-7b"][od]
    env.reset(seed=0)
    seen = set()
    done = False
    obs, info = env.reset(seed=0)
    while not done:  # every request only ever valid where its model fits
        m = env.r_m
        assert not (info["action_mask"][: env.n] & ~env.fits[m]).any()
        seen.add(env.model_names[m])
        valid = np.flatnonzero(info["action_mask"])
        obs, _, _, done, info = env.step(int(valid[0]) if valid.size else 0)
    assert seen == set(MODELS)


def test_an_unknown_model_is_a_clear_error(multi: Path, tmp_path: Path) -> None:
    w = pd.read_csv(multi / "workload.csv")
    bad = write_tiny_bundle(tmp_path / "bad", n_requests=20)
    w2 = pd.read_csv(bad / "workload.csv").assign(model="llama-2-7b")
    w2.loc[3, "model"] = "llama-9000b"
    w2.to_csv(bad / "workload.csv", index=False)
    with pytest.raises(ConfigError, match="field 'model': unknown model 'llama-9000b'"):
        CloudRouteEnv(str(bad))
    assert set(w["model"]) == set(MODELS)
