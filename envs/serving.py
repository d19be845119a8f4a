"""Where each model runs and how fast: the per-(model, offering) pool parameters of the simulator.

``configs/serving.yaml`` measured one reference model per accelerator; ``configs/models.yaml``
lists the models requests name and the rules that carry those speeds to them (its header has the
rules and the published figures they were fitted on). :func:`place` applies them to a catalog.
Every array is shaped (models, offerings); a pool is one (model, offering) pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from xroute.config import ModelsConfig, ServingConfig, config_path, parse_config, read_yaml
from xroute.errors import ConfigError
from xroute.schema.offering import Offering

_GB, _MIB = 1e9, float(2**20)


def load_serving(name: str) -> ServingConfig:
    path = config_path(name)
    return parse_config(ServingConfig, read_yaml(path), str(path))


def load_models(name: str) -> ModelsConfig:
    path = config_path(name)
    cfg = parse_config(ModelsConfig, read_yaml(path), str(path))
    for field in ("default_model", "reference_model"):
        value = getattr(cfg, field)
        if value not in cfg.models:
            raise ConfigError(f"{path}: field '{field}': '{value}' is not under models ({', '.join(cfg.models)})")
    return cfg


@dataclass(frozen=True)
class Placement:
    """The pools of every (model, offering) pair; arrays (M, n)."""

    models: tuple[str, ...]
    params_b: np.ndarray      # (M,)
    fits: np.ndarray          # bool: the model fits on one instance of the offering
    gpus: np.ndarray          # GPUs one replica spans (0 where it does not fit)
    replicas: np.ndarray      # replicas the pool holds (capacity_replicas // gpus)
    conc: np.ndarray          # request slots per replica
    prefill_tok_s: np.ndarray
    tpot_s: np.ndarray        # seconds per output token at concurrency 1
    growth: np.ndarray        # tpot(k) = tpot * (1 + growth*(k-1))
    sigma: np.ndarray         # lognormal sigma of the service time
    #: KV-cache tokens one replica holds once its weights are loaded (0 where the model does not fit):
    #: the memory its prefix cache of blocks lives in (``envs.prefix``)
    kv_tokens: np.ndarray

    @property
    def slots(self) -> np.ndarray:
        return (self.replicas * self.conc).astype(np.int64)


def place(catalog: list[Offering], capacity: list[int], serving: ServingConfig, models: ModelsConfig,
          only: list[str] | None = None) -> Placement:
    """Apply the rules of ``configs/models.yaml`` to every offering (for the models ``only``, in
    that order, when given). ``capacity[i]`` is the GPUs the pool of offering i holds (its
    ``capacity_replicas``: one-GPU replicas of the reference model)."""
    names = tuple(only) if only is not None else tuple(models.models)
    m_, n = len(names), len(catalog)
    shape = (m_, n)
    fits = np.zeros(shape, dtype=bool)
    gpus, replicas, conc = np.zeros(shape), np.zeros(shape), np.ones(shape)
    prefill, tpot, growth, sigma = np.ones(shape), np.ones(shape), np.zeros(shape), np.zeros(shape)
    kv = np.zeros(shape)
    ref = models.models[models.reference_model]
    for i, o in enumerate(catalog):
        acc = serving.accelerators.get(o.accelerator)
        if acc is None:
            raise ConfigError(f"serving config: field 'accelerators': no entry for accelerator "
                              f"'{o.accelerator or '(none)'}' used by offering {o.offering_id}")
        count = max(1, int(o.accelerator_count))
        for k, name in enumerate(names):
            spec = models.models[name]
            sigma[k, i] = acc.noise_sigma
            if name == models.reference_model:  # measured: serving.yaml as it is, one GPU per replica
                g, slots_per = 1, acc.max_concurrency
                pf, tp, gr = acc.prefill_tok_s, acc.tpot_ms / 1000.0, acc.tpot_growth
                tokens = max(_kv_tokens(acc.memory_gb, 1, spec.weights_gb, spec.kv_mib_per_token, models.kv_fraction),
                             0.0)
            else:
                g = 1
                while g <= count and _kv_tokens(acc.memory_gb, g, spec.weights_gb, spec.kv_mib_per_token,
                                                 models.kv_fraction) < models.min_context_tokens:
                    g *= 2
                if g > count:
                    continue  # does not fit on this instance: the pool stays empty (masked)
                tokens = _kv_tokens(acc.memory_gb, g, spec.weights_gb, spec.kv_mib_per_token, models.kv_fraction)
                slots_per = max(1, int(tokens // (spec.slot_context_tokens or models.nominal_context_tokens)))
                steps = math.log2(g)
                tp = acc.tpot_ms / 1000.0 * (spec.weights_gb / ref.weights_gb) / (g * models.tp_efficiency ** steps)
                pf = acc.prefill_tok_s * (ref.params_b / spec.params_b) * g * models.prefill_tp_efficiency ** steps
                gr = acc.tpot_growth if spec.tpot_growth is None else spec.tpot_growth
            if o.max_batch:  # a serving tier held at a smaller batch (Offering.max_batch; its KV memory the same)
                slots_per = min(slots_per, o.max_batch)
            fits[k, i] = True
            kv[k, i] = tokens
            gpus[k, i] = g
            replicas[k, i] = capacity[i] // g
            conc[k, i] = slots_per
            prefill[k, i], tpot[k, i], growth[k, i] = pf, tp, gr
    params = np.array([models.models[nm].params_b for nm in names])
    return Placement(names, params, fits, gpus, replicas, conc, prefill, tpot, growth, sigma, kv)


def _kv_tokens(memory_gb: float, g: int, weights_gb: float, kv_mib: float, fraction: float) -> float:
    """KV-cache tokens left on ``g`` accelerators once the weights are loaded."""
    return (fraction * memory_gb * g - weights_gb) * _GB / (kv_mib * _MIB)
