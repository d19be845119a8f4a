"""Gymnasium environments over replayed telemetry. Importing this package registers
``xroute/CloudRoute-v0`` (``gymnasium.make("xroute/CloudRoute-v0", bundle=DIR)``)."""

from gymnasium.envs.registration import register, registry

from envs.cloud_route import CloudRouteEnv

ENV_ID = "xroute/CloudRoute-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="envs.cloud_route:CloudRouteEnv")

__all__ = ["ENV_ID", "CloudRouteEnv"]
