"""Gymnasium environments over replayed telemetry. Importing this package registers
``xroute/CloudRoute-v0`` (``gymnasium.make("xroute/CloudRoute-v0", bundle=DIR)``) and
``xroute/Provision-v0``, the provisioning world for a capacity planner (``envs.provisioning``)."""

from gymnasium.envs.registration import register, registry

from envs.cloud_route import CloudRouteEnv

ENV_ID = "xroute/CloudRoute-v0"
PROVISION_ENV_ID = "xroute/Provision-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="envs.cloud_route:CloudRouteEnv")
if PROVISION_ENV_ID not in registry:
    register(id=PROVISION_ENV_ID, entry_point="envs.provisioning:ProvisionEnv")

__all__ = ["ENV_ID", "PROVISION_ENV_ID", "CloudRouteEnv"]
