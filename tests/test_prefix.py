"""The prefix caches (``envs.prefix``) against plain reference implementations on random block
streams: the servers' per-replica LRU caches (the truth) and the router's aging record (its view)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from envs import prefix as px


class RefReplica:
    """One replica's LRU cache, the obvious way: an OrderedDict, most recent last."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.d: OrderedDict[int, float] = OrderedDict()

    def run(self, blocks: list[int], t: float) -> int:
        k = 0
        for b in blocks:
            if b not in self.d or self.d[b] > t:
                break
            k += 1
        return k

    def fill(self, blocks: list[int], ready: float) -> None:
        for b in reversed(blocks):  # the last block first: the first ends most recent
            if b in self.d:
                self.d.move_to_end(b)
                continue
            if self.capacity <= 0:
                continue
            if len(self.d) >= self.capacity:
                self.d.popitem(last=False)
            self.d[b] = ready

    def order(self) -> list[int]:
        return list(reversed(self.d))


def _stream(rng: np.random.Generator, n: int, vocab: int) -> list[list[int]]:
    """Prompts that share prefixes as conversations do: a new one, or an earlier one extended."""
    out: list[list[int]] = []
    for _ in range(n):
        if out and rng.random() < 0.6:
            base = out[int(rng.integers(len(out)))]
            keep = int(rng.integers(1, len(base) + 1))
            out.append(base[:keep] + [int(x) for x in rng.integers(0, vocab, int(rng.integers(0, 6)))])
        else:
            out.append([int(x) for x in rng.integers(0, vocab, int(rng.integers(1, 12)))])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_replica_caches_match_a_reference_lru(seed: int) -> None:
    rng = np.random.default_rng(seed)
    replicas, conc, capacity = int(rng.integers(1, 5)), int(rng.integers(1, 3)), int(rng.integers(0, 24))
    kv = px.PoolKV(replicas, capacity, nodes=4)  # small first: the arrays grow as blocks arrive
    ref = [RefReplica(capacity) for _ in range(replicas)]
    free = np.full(replicas * conc, -np.inf)
    t = 0.0
    for prompt in _stream(rng, 300, 40):
        t += float(rng.exponential(1.0))
        blocks = np.array(prompt, dtype=np.int64)
        j, hit = kv.place(free, conc, t, blocks)
        # the reference's choice: the free replicas' longest ready prefix, else the first-freeing slot's
        n_free = [int((free[r * conc:(r + 1) * conc] <= t).sum()) for r in range(replicas)]
        cands = [r for r in range(replicas) if n_free[r]] or [int(np.argmin(free)) // conc]
        runs = {r: ref[r].run(prompt, t) for r in cands}
        best = max(cands, key=lambda r: (runs[r], n_free[r], -r))  # longest prefix, least loaded, first
        assert (j // conc, hit) == (best, runs[best])
        ready = t + float(rng.uniform(0, 3))
        kv.fill(best, blocks, ready)
        ref[best].fill(prompt, ready)
        free[j] = max(free[j], t) + float(rng.exponential(2.0))
        for r in range(replicas):
            assert kv.resident(r) == ref[r].order()[: len(kv.resident(r))] and len(kv.resident(r)) == len(ref[r].d)


def test_a_prompt_longer_than_the_cache_keeps_its_leading_blocks() -> None:
    kv = px.PoolKV(1, 5)
    kv.fill(0, np.arange(12, dtype=np.int64), 0.0)
    assert kv.resident(0) == [0, 1, 2, 3, 4]
    _, hit = kv.place(np.zeros(1), 1, 1.0, np.arange(12, dtype=np.int64))
    assert hit == 5


def test_a_block_counts_once_its_prefill_ended() -> None:
    kv = px.PoolKV(1, 8)
    kv.fill(0, np.arange(4, dtype=np.int64), ready=10.0)
    assert kv.place(np.zeros(1), 1, 9.0, np.arange(4, dtype=np.int64))[1] == 0
    assert kv.place(np.zeros(1), 1, 10.0, np.arange(4, dtype=np.int64))[1] == 4


def test_copies_are_independent() -> None:
    kv = px.PoolKV(2, 6)
    kv.fill(0, np.arange(4, dtype=np.int64), 0.0)
    c = kv.copy(owner=7)
    c.fill(0, np.arange(10, 16, dtype=np.int64), 0.0)
    assert kv.resident(0) == [0, 1, 2, 3] and c.resident(0)[:2] == [10, 11]


class RefView:
    """The router's view, the obvious way: per (block, pool) the last (time, stamp), K per block."""

    def __init__(self, k: int):
        self.k = k
        self.entries: dict[int, OrderedDict[int, tuple[float, int]]] = {}
        self.sent: dict[int, int] = {}

    def record(self, blocks: list[int], pool: int, t: float) -> None:
        base = self.sent.get(pool, 0)
        for i, b in enumerate(blocks):
            e = self.entries.setdefault(b, OrderedDict())
            if pool not in e and len(e) >= self.k:
                oldest = min(e, key=lambda p: e[p][0])
                del e[oldest]
            e[pool] = (t, base + len(blocks) - 1 - i)
        self.sent[pool] = base + len(blocks)

    def run(self, blocks: list[int], pool: int, now: float, cutoff: float, cap: int) -> int:
        k = 0
        for b in blocks:
            e = self.entries.get(b, {}).get(pool)
            if e is None or e[0] > now or e[0] < cutoff or self.sent.get(pool, 0) - e[1] >= cap:
                break
            k += 1
        return k


@pytest.mark.parametrize("seed", range(4))
def test_the_view_matches_a_reference_record(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    n_pools, k, ttl = 6, 3, 40.0
    cap = rng.integers(5, 60, n_pools).astype(np.int64)
    hv = px.HashedView(pools=2, rows=8, k=k)  # grows its pools and rows as they come
    ref = RefView(k)
    run = np.zeros(n_pools, dtype=np.int64)
    t = 0.0
    for prompt in _stream(rng, 400, 60):
        t += float(rng.exponential(1.0))
        hashes = np.array(prompt, dtype=np.int64) * 7919 - 123456789  # any int64, negative included
        hv.ensure_pools(n_pools)
        hv.cap[:] = cap
        hv.lookup(hashes, 0, n_pools, t, t - ttl, run)
        assert run.tolist() == [ref.run(prompt, p, t, t - ttl, int(cap[p])) for p in range(n_pools)]
        p = int(rng.integers(n_pools))
        ready = t + float(rng.uniform(0, 3))  # the blocks computed there by its first token
        hv.record(hashes, p, ready, int(cap[p]), keep_from=t - ttl)
        ref.record(prompt, p, ready)


def test_expected_cached_tokens_and_retention() -> None:
    out = np.zeros(3)
    px.expected_cached(np.array([0, 2, 9]), 512, 3000.0, np.array([1.0, 0.5, 1.0]), out)
    assert out.tolist() == [0.0, 512.0, 3000.0]
    ret = np.ones(2)
    px.retention_update(ret, 1, 1000.0, 0.0, 0.5)  # predicted 1000 cached, the server had none
    px.retention_update(ret, 0, 0.0, 500.0, 0.5)  # nothing predicted: nothing to correct
    assert ret.tolist() == [1.0, 0.5]


# ---------------------------------------------------------------------------------- the environment
@pytest.fixture(scope="module")
def mooncake() -> object:
    from xroute.bundle import load_bundle

    return load_bundle("mooncake")


def _greedy_steps(env: object, k: int) -> list[tuple[float, float]]:
    out = []
    for _ in range(k):
        a = int(np.argmax(env.expected_rewards()))  # type: ignore[attr-defined]
        _, r, _, _, info = env.step(a)  # type: ignore[attr-defined]
        out.append((r, info["cached_tokens"]))
    return out


def test_snapshots_forks_and_copies_keep_the_servers_caches_apart(mooncake: object) -> None:
    """The caches are shared with a snapshot or a fork until one side writes (copy on write): each
    copy plays on as an independent deep copy would, and the original is untouched."""
    import copy

    from envs.cloud_route import CloudRouteEnv
    from models.warmstart import fork

    env = CloudRouteEnv(mooncake, episode_requests=None)  # type: ignore[arg-type]
    env.reset(seed=1, options={"start": 0, "end": 700})
    _greedy_steps(env, 200)
    ref = copy.deepcopy(env)
    sim = fork(env)
    played = _greedy_steps(sim, 150)
    assert sum(c for _, c in played) > 0  # the caches were in play
    assert _greedy_steps(env, 150) == _greedy_steps(ref, 150) == played
    snap = env.save_state()
    first = _greedy_steps(env, 100)
    env.restore_state(snap)
    assert _greedy_steps(env, 100) == first
    env.restore_state(snap)  # the snapshot is reusable: its caches were never written
    assert _greedy_steps(env, 100) == first


def test_the_hit_accounting_adds_up(mooncake: object) -> None:
    """Each step's cached tokens: at most its prompt, a whole number of blocks (or the whole prompt,
    its last block partial), zero for the first request of a prefix; the episode's sums are the
    statistics evaluate reports."""
    from envs.cloud_route import CloudRouteEnv

    env = CloudRouteEnv(mooncake, episode_requests=None)  # type: ignore[arg-type]
    env.reset(seed=2, options={"start": 0, "end": 600})
    seen: set[int] = set()
    prompt = cached = 0.0
    for _ in range(599):
        i = env._pos
        blocks = set(env.req_blk[env.req_blk_off[i]:env.req_blk_off[i + 1]].tolist())
        fresh = not (blocks & seen)
        seen |= blocks
        a = int(np.argmax(env.expected_rewards()))
        _, _, _, _, info = env.step(a)
        c, p = info["cached_tokens"], info["prompt_tokens"]
        assert p == env.req_in[i] and 0 <= c <= p
        assert c == p or c % env.block_tokens == 0
        if fresh:
            assert c == 0
        prompt += p
        cached += c
    assert 0.02 < cached / prompt < 0.64  # some reuse (the first minutes: caches cold), never above the 64 % repeated


def test_every_observation_of_the_prefix_bundle_is_finite_and_within_bounds(mooncake: object) -> None:
    """Its model does not fit every offering (the masked pools' waits are infinite): no feature of
    any row may be NaN or outside the declared bounds -- a learned router's masked mean over the
    rows, and its training, would turn one NaN into every score (it did: the preemption risk was
    0 x inf there before)."""
    from envs.cloud_route import CloudRouteEnv

    env = CloudRouteEnv(mooncake, episode_requests=None)  # type: ignore[arg-type]
    obs, _ = env.reset(seed=3, options={"start": 0, "end": 400})
    assert not env.fits[env.default_model if env.M == 1 else 1].all()  # some offering cannot hold it
    space = env.observation_space
    for _ in range(399):
        for k in ("offerings", "request", "mask"):
            assert np.isfinite(obs[k]).all(), k
            assert space[k].contains(obs[k]), k
        obs, *_ = env.step(int(np.argmax(env.expected_rewards())))
