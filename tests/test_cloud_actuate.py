"""Inventory and actuation through the cloud adapters (issue 37 item 4; docs/capacity.md, "Actuation and
its safety limits"): real boto3 against moto's server (Auto Scaling groups, EC2), the real Azure and GCP
clients against local stand-ins serving recorded payloads and recording what they are asked to change.

``xroute capacity apply`` is dry run by default; with ``--apply`` it moves each pool by at most
``max_step``; a plan above a quota or the USD/hour limit, an unknown pool or a bad limit is refused naming
the field with nothing changed; a run killed between two changes resumes without making one twice.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from cloud_adapters.aws import AwsAdapter, AwsConfig
from cloud_adapters.azure import AzureAdapter, AzureConfig
from cloud_adapters.base import PoolGroup
from cloud_adapters.collect.commit import read_tables
from cloud_adapters.collect.config import CollectConfig
from cloud_adapters.collect.run import collect_once
from cloud_adapters.gcp import GcpAdapter, GcpConfig
from router.store.capacity import CapacityJournal
from tests.clouds import Fault, local_clouds, moto_url
from xroute.errors import XrouteError
from xroute_app.cli import app

logging.getLogger("werkzeug").setLevel(logging.ERROR)
ROOT = Path(__file__).resolve().parent.parent
FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 5.0}
MODEL = "llama-2-7b"
G5 = "aws:us-east-1:g5.xlarge:on_demand"
G4 = "aws:us-east-1:g4dn.xlarge:on_demand"
T4 = "azure:eastus:Standard_NC4as_T4_v3:on_demand"
L4 = "gcp:us-central1:g2-standard-4:on_demand"


@pytest.fixture(scope="module")
def clouds():
    with local_clouds() as c:
        yield c


@pytest.fixture
def env(clouds, monkeypatch):
    clouds.reset()
    for k, v in clouds.env.items():
        monkeypatch.setenv(k, v)
    return clouds


# -- helpers ---------------------------------------------------------------------------------------------


def asg(name: str, itype: str, desired: int, max_size: int = 32) -> None:
    """An Auto Scaling group in moto (us-east-1) with ``desired`` instances of ``itype``."""
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_url())
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ec2.create_launch_template(LaunchTemplateName=f"lt-{name}", LaunchTemplateData={"ImageId": ami, "InstanceType": itype})
    boto3.client("autoscaling", region_name="us-east-1", endpoint_url=moto_url()).create_auto_scaling_group(
        AutoScalingGroupName=name, LaunchTemplate={"LaunchTemplateName": f"lt-{name}", "Version": "$Latest"},
        MinSize=0, MaxSize=max_size, DesiredCapacity=desired, AvailabilityZones=["us-east-1a"])


def desired(name: str) -> int:
    g = boto3.client("autoscaling", region_name="us-east-1", endpoint_url=moto_url()).describe_auto_scaling_groups(
        AutoScalingGroupNames=[name])["AutoScalingGroups"][0]
    return int(g["DesiredCapacity"])


def telemetry(root: Path, offerings: list[tuple[str, float, int, float]], quotas: list[dict]) -> Path:
    """A collector's bundle directory: offerings (id, vCPUs, GPUs, USD/h), their prices, and quotas."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for oid, vcpus, gpus, _ in offerings:
        provider, region, itype, mode = oid.split(":")
        rows.append({"offering_id": oid, "provider": provider, "region": region, "zone": "", "instance_type": itype,
                     "accelerator": "A10G", "accelerator_count": gpus, "vcpus": vcpus, "memory_gib": 16,
                     "pricing_mode": mode})
    pd.DataFrame(rows).to_csv(root / "offerings.csv", index=False)
    pd.DataFrame([{"ts": "2024-05-01T00:00:00Z", "offering_id": oid, "usd_per_hour": usd}
                  for oid, _, _, usd in offerings]).to_csv(root / "prices.csv", index=False)
    if quotas:
        pd.DataFrame([{"ts": "2024-05-01T00:00:00Z", **q} for q in quotas]).to_csv(root / "quotas.csv", index=False)
    read_tables(root)  # valid as the collector writes it
    return root


AWS_TELEMETRY = ([(G5, 4.0, 1, 1.006), (G4, 4.0, 1, 0.526)],
                 [{"provider": "aws", "region": "us-east-1", "quota_name": "Running On-Demand G and VT instances",
                   "unit": "vcpus", "limit": 64.0, "usage": 8.0, "covers": "aws:us-east-1:g*:on_demand"}])


def plan_file(path: Path, pools: list[tuple[str, int]], at: str = "2024-05-02T10:00:00Z") -> Path:
    path.write_text(json.dumps({"version": 1, "at": at, "planner": "spothedge", "source": "test", "epoch_s": 60,
                                "usd_per_hour": 1.0, "pools": [{"offering_id": o, "model": MODEL, "target": t}
                                                               for o, t in pools]}))
    return path


def config_file(path: Path, provider_options: dict, limits: dict | None = None) -> Path:
    path.write_text(yaml.safe_dump({"provider_options": provider_options, **({"limits": limits} if limits else {})}))
    return path


def cli(*args: str) -> tuple[int, str]:
    """``xroute ...`` in process, as ``xroute_app.cli.main`` ends it: an XrouteError is one line, exit 2."""
    r = CliRunner().invoke(app, list(args))
    if isinstance(r.exception, XrouteError):
        return 2, f"xroute: error: {r.exception}"
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.output


def aws_setup(tmp_path: Path, g5: int = 2, g4: int = 3) -> tuple[dict, Path]:
    names = {"g5": f"g5-{uuid.uuid4().hex[:8]}", "g4": f"g4-{uuid.uuid4().hex[:8]}"}
    asg(names["g5"], "g5.xlarge", g5)
    asg(names["g4"], "g4dn.xlarge", g4)
    cfg = config_file(tmp_path / "actuate.yaml", {"aws": {**FAST, "groups": [
        {"offering_id": G5, "model": MODEL, "group": names["g5"]},
        {"offering_id": G4, "model": MODEL, "group": names["g4"]}]}})
    telemetry(tmp_path / "telemetry", *AWS_TELEMETRY)
    return names, cfg


def apply_args(tmp_path: Path, plan: Path, cfg: Path, *extra: str) -> list[str]:
    return ["capacity", "apply", "--plan", str(plan), "--telemetry", str(tmp_path / "telemetry"), "--config", str(cfg),
            "--db", str(tmp_path / "log.db"), *extra]


# -- inventory ---------------------------------------------------------------------------------------------


def test_aws_inventory_from_an_auto_scaling_group_and_from_tags(env):
    name = f"g5-{uuid.uuid4().hex[:8]}"
    asg(name, "g5.xlarge", 3, max_size=8)
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_url())
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    tag = uuid.uuid4().hex[:8]
    ec2.run_instances(ImageId=ami, InstanceType="g4dn.xlarge", MinCount=2, MaxCount=2, TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": "xroute-pool", "Value": tag}]}])
    a = AwsAdapter({**FAST, "groups": [{"offering_id": G5, "model": MODEL, "group": name},
                                       {"offering_id": G4, "tags": {"xroute-pool": tag}}]})
    inv = {g.pool.offering_id: g for g in a.inventory()}
    assert (inv[G5].desired, inv[G5].running, inv[G5].launching, inv[G5].max_size) == (3, 3, 0, 8)
    assert (inv[G4].desired, inv[G4].running) == (2, 2)
    assert env.aws.actions["DescribeAutoScalingGroups"] == 1 and env.aws.actions["DescribeInstances"] == 1


def test_azure_inventory_from_the_scale_set_and_its_vms(env):
    a = AzureAdapter({**FAST, "groups": [{"offering_id": T4, "model": MODEL, "group": "xroute-t4",
                                          "resource_group": "xroute-rg"}]})
    (g,) = a.inventory()
    assert (g.desired, g.running, g.launching) == (3, 2, 1)  # sku.capacity; two VMs Succeeded, one Creating
    assert env.azure.hits["vmss"] == 1 and env.azure.hits["vmss_vms"] == 1
    assert any("/resourceGroups/xroute-rg/providers/Microsoft.Compute/virtualMachineScaleSets/xroute-t4/virtualMachines"
               in path for _, _, path in env.azure.log)


def test_gcp_inventory_from_the_managed_instance_group(env):
    a = GcpAdapter({**FAST, "groups": [{"offering_id": L4, "model": MODEL, "group": "xroute-l4",
                                        "zone": "us-central1-a"}]})
    (g,) = a.inventory()
    assert (g.desired, g.running, g.launching) == (3, 2, 1)  # targetSize; currentActions none 2, creating 1
    assert env.gcp.log[-1][2].startswith("/compute/v1/projects/xroute-test/zones/us-central1-a/"
                                         "instanceGroupManagers/xroute-l4")


def test_the_collector_writes_the_inventory_table(env, tmp_path):
    out = tmp_path / "b"
    cfg = CollectConfig(providers=["azure"], regions={"azure": ["eastus"]}, out=out, origin="aws:us-east-1",
                        deadline_s=60, rtt_probes=2, rtt_timeout_s=0.5, provider_options={"azure": {**FAST, "groups": [
                            {"offering_id": T4, "model": MODEL, "group": "xroute-t4", "resource_group": "xroute-rg"},
                            {"offering_id": "azure:eastus:Standard_Nope:on_demand", "group": "nope",
                             "resource_group": "xroute-rg"}]}})
    report = collect_once(cfg)
    assert next(s for s in report.sources if s["source"] == "azure/inventory")["status"] == "ok"
    inv = read_tables(out)["inventory"]
    assert inv[["offering_id", "model", "running", "launching"]].values.tolist() == [[T4, MODEL, 2, 1]]
    assert any("Standard_Nope" in h for h in report.record["held_back"])  # not an offering: held back
    collect_once(cfg)  # the same counts again: a step function, no new row
    assert len(read_tables(out)["inventory"]) == 1


def test_group_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"groups\[0\]\.zone: required for a gcp group"):
        GcpConfig(groups=[{"offering_id": L4, "group": "x"}])
    with pytest.raises(ValueError, match=r"groups\[0\]\.zone: 'europe-west4-a' is not a zone"):
        GcpConfig(groups=[{"offering_id": L4, "group": "x", "zone": "europe-west4-a"}])
    with pytest.raises(ValueError, match=r"groups\[0\]\.resource_group: required for a azure group"):
        AzureConfig(groups=[{"offering_id": T4, "group": "x"}])
    with pytest.raises(ValueError, match=r"groups\[0\]\.offering_id: 'gcp:us-central1:x:spot' is not a aws offering"):
        AwsConfig(groups=[{"offering_id": "gcp:us-central1:x:spot", "group": "x"}])
    with pytest.raises(ValueError, match=r"groups\[1\]: pool .* is already groups\[0\]"):
        AwsConfig(groups=[{"offering_id": G5, "group": "a"}, {"offering_id": G5, "group": "b"}])
    assert PoolGroup(offering_id=G5, group="a").region == "us-east-1"


# -- actuation: AWS (moto) ------------------------------------------------------------------------------


def test_dry_run_is_the_default_and_changes_nothing(env, tmp_path):
    names, cfg = aws_setup(tmp_path)
    plan = plan_file(tmp_path / "plan.json", [(G5, 6), (G4, 1)])
    code, out = cli(*apply_args(tmp_path, plan, cfg, "--max-usd-per-hour", "10", "--max-step", "2"))
    assert code == 0, out
    assert f"{G5}@{MODEL}: 2 -> 4 (target 6): would change" in out
    assert "dry run: nothing changed (2 change(s) would be made)" in out
    assert (desired(names["g5"]), desired(names["g4"])) == (2, 3)
    assert env.aws.actions["SetDesiredCapacity"] == 0
    assert not (tmp_path / "log.db").exists()  # a dry run journals nothing


def test_apply_moves_each_pool_by_at_most_max_step_and_audits_every_change(env, tmp_path):
    names, cfg = aws_setup(tmp_path)
    plan = plan_file(tmp_path / "plan.json", [(G5, 6), (G4, 1)])
    code, out = cli(*apply_args(tmp_path, plan, cfg, "--max-usd-per-hour", "10", "--max-step", "2", "--apply"))
    assert code == 0, out
    assert (desired(names["g5"]), desired(names["g4"])) == (4, 1)  # 2 -> 4 (step 2 of 4), 3 -> 1
    assert env.aws.actions["SetDesiredCapacity"] == 2
    j = CapacityJournal(tmp_path / "log.db", "test")
    entries = j.entries()
    j.close()
    assert [(e["kind"], e["action"], e["after"]["offering_id"], e["after"]["before"], e["after"]["after"])
            for e in entries] == [("capacity", "intended", G5, 2, 4), ("capacity", "applied", G5, 2, 4),
                                  ("capacity", "intended", G4, 3, 1), ("capacity", "applied", G4, 3, 1)]
    assert entries[0]["principal"].startswith("cli:")
    # the same plan again: already applied, nothing called
    code, out = cli(*apply_args(tmp_path, plan, cfg, "--max-usd-per-hour", "10", "--max-step", "2", "--apply"))
    assert code == 0 and out.count("already applied") == 2
    assert env.aws.actions["SetDesiredCapacity"] == 2 and desired(names["g5"]) == 4


@pytest.mark.parametrize(("pools", "args", "message"), [
    ([(G5, 20)], ["--max-usd-per-hour", "100", "--max-step", "2"],
     "pools[0].target: the plan's increases need 72 vcpus of quota 'Running On-Demand G and VT instances' "
     "(aws us-east-1), which has 56 left"),
    ([(G5, 6), (G4, 1)], ["--max-usd-per-hour", "5", "--max-step", "2"],
     "max_usd_per_hour: the plan's targets cost 6.56 USD/h at the telemetry's latest prices, above the limit 5.00"),
    ([(G5, 3), ("aws:us-east-1:p5.48xlarge:on_demand", 1)], ["--max-usd-per-hour", "100", "--max-step", "2"],
     f"pools[1]: unknown pool aws:us-east-1:p5.48xlarge:on_demand@{MODEL}: no group in provider_options.aws.groups"),
    ([(G5, 3)], ["--max-usd-per-hour", "-1", "--max-step", "2"],
     "max_usd_per_hour: Input should be greater than 0 (got -1.0)"),
    ([(G5, 3)], ["--max-step", "2"], "max_usd_per_hour: required"),
    ([(G5, 3)], ["--max-usd-per-hour", "10", "--max-step", "0"], "max_step: Input should be greater than or equal to 1"),
    ([(G5, 40)], ["--max-usd-per-hour", "100", "--max-step", "2"], "pools[0].target: 40 is above the max size 32"),
])
def test_a_plan_breaking_a_limit_is_refused_naming_the_field_and_nothing_changes(env, tmp_path, pools, args, message):
    names, cfg = aws_setup(tmp_path)
    plan = plan_file(tmp_path / "plan.json", pools)
    code, out = cli(*apply_args(tmp_path, plan, cfg, *args, "--apply"))
    assert code == 2 and message in out, out
    assert len(out.strip().splitlines()) == 1
    assert env.aws.actions["SetDesiredCapacity"] == 0
    assert (desired(names["g5"]), desired(names["g4"])) == (2, 3)


def test_a_bad_plan_file_names_the_field(env, tmp_path):
    _, cfg = aws_setup(tmp_path)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "at": "2024-05-02T10:00:00Z", "planner": "x", "epoch_s": 60,
                                "usd_per_hour": 1, "pools": [{"offering_id": G5, "model": MODEL, "target": -3}]}))
    code, out = cli(*apply_args(tmp_path, plan, cfg, "--max-usd-per-hour", "10", "--max-step", "2", "--apply"))
    assert code == 2 and "pools.0.target: Input should be greater than or equal to 0 (got -3)" in out
    assert env.aws.actions["SetDesiredCapacity"] == 0


def test_limits_from_the_config_file_and_the_refusal_from_the_real_command(env, tmp_path):
    """The installed entry point (``xroute_app.cli.main``): one line on stderr, exit 2, nothing launched."""
    names, cfg = aws_setup(tmp_path)
    config_file(cfg, yaml.safe_load(cfg.read_text())["provider_options"], {"max_usd_per_hour": -5, "max_step": 1})
    plan = plan_file(tmp_path / "plan.json", [(G5, 3)])
    r = subprocess.run([sys.executable, "-m", "xroute_app", *apply_args(tmp_path, plan, cfg, "--apply")],
                       env={**os.environ, **env.env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "xroute: error: max_usd_per_hour: Input should be greater than 0 (got -5)"
    assert env.aws.actions["SetDesiredCapacity"] == 0 and desired(names["g5"]) == 2


@pytest.mark.slow
def test_a_run_killed_between_changes_resumes_without_making_one_twice(env, tmp_path):
    """The first resize reaches moto and is carried out, but its answer never comes back; the run is
    killed (SIGKILL) while it waits. The rerun finds that change made (journaled ``intended``, the
    group already at its ``after``) and makes only the second: two resizes in all, each pool one step."""
    names, cfg = aws_setup(tmp_path)
    plan = plan_file(tmp_path / "plan.json", [(G5, 6), (G4, 1)])
    args = apply_args(tmp_path, plan, cfg, "--max-usd-per-hour", "10", "--max-step", "2", "--apply")
    env.aws.inject("SetDesiredCapacity", Fault.swallow(60.0))
    proc = subprocess.Popen([sys.executable, "-m", "xroute_app", *args], env={**os.environ, **env.env,
                            "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while desired(names["g5"]) != 4:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the first change never reached moto"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert env.aws.actions["SetDesiredCapacity"] == 1 and desired(names["g4"]) == 3
    j = CapacityJournal(tmp_path / "log.db", "test")
    assert [e["action"] for e in j.entries()] == ["intended"]  # recorded before the call; the outcome never came
    j.close()

    code, out = cli(*args)
    assert code == 0, out
    assert f"{G5}@{MODEL}: 4 -> 4 (target 6): found applied" in out
    assert env.aws.actions["SetDesiredCapacity"] == 2  # the second pool's only: none made twice
    assert (desired(names["g5"]), desired(names["g4"])) == (4, 1)
    j = CapacityJournal(tmp_path / "log.db", "test")
    assert [(e["action"], e["after"]["offering_id"]) for e in j.entries()] == [
        ("intended", G5), ("applied", G5), ("intended", G4), ("applied", G4)]
    j.close()


def test_a_change_the_cloud_refuses_is_journaled_failed_and_retried_by_the_next_run(env, tmp_path):
    names, cfg = aws_setup(tmp_path)
    plan = plan_file(tmp_path / "plan.json", [(G5, 3)])
    args = apply_args(tmp_path, plan, cfg, "--max-usd-per-hour", "10", "--max-step", "2", "--apply")
    env.aws.inject("SetDesiredCapacity", Fault.error(503))
    code, _ = cli(*args)
    assert code == 1 and desired(names["g5"]) == 2
    assert env.aws.actions["SetDesiredCapacity"] == 1  # a mutation's 5xx is not retried: its outcome is unknown
    code, out = cli(*args)
    assert code == 0 and "2 -> 3 (target 3): applied" in out and desired(names["g5"]) == 3


# -- actuation: Azure and GCP (recorded stand-ins) -------------------------------------------------------------


def test_azure_apply_patches_the_scale_set_capacity_and_a_dry_run_does_not(env, tmp_path):
    cfg = config_file(tmp_path / "a.yaml", {"azure": {**FAST, "groups": [
        {"offering_id": T4, "model": MODEL, "group": "xroute-t4", "resource_group": "xroute-rg"}]}},
        {"max_usd_per_hour": 10, "max_step": 1})
    telemetry(tmp_path / "telemetry", [(T4, 4.0, 1, 0.526)], [
        {"provider": "azure", "region": "eastus", "quota_name": "standardNCASv3_T4Family", "unit": "vcpus",
         "limit": 24.0, "usage": 12.0, "covers": T4}])
    plan = plan_file(tmp_path / "plan.json", [(T4, 5)])
    code, out = cli(*apply_args(tmp_path, plan, cfg))
    assert code == 0 and "3 -> 4 (target 5): would change" in out
    assert "vmss" not in env.azure.changes
    code, out = cli(*apply_args(tmp_path, plan, cfg, "--apply"))
    assert code == 0, out
    ((path, body),) = env.azure.changes["vmss"]
    assert "/resourceGroups/xroute-rg/providers/Microsoft.Compute/virtualMachineScaleSets/xroute-t4?api-version=" in path
    assert json.loads(body) == {"sku": {"capacity": 4}}
    # over the family quota: 5 more T4 instances take 20 vCPUs, 12 are left
    code, out = cli(*apply_args(tmp_path, plan_file(tmp_path / "p2.json", [(T4, 9)]), cfg, "--apply"))
    assert code == 2 and "quota 'standardNCASv3_T4Family' (azure eastus), which has 12 left" in out
    assert len(env.azure.changes["vmss"]) == 1


def test_gcp_apply_resizes_the_managed_instance_group(env, tmp_path):
    cfg = config_file(tmp_path / "g.yaml", {"gcp": {**FAST, "groups": [
        {"offering_id": L4, "model": MODEL, "group": "xroute-l4", "zone": "us-central1-a"}]}},
        {"max_usd_per_hour": 10, "max_step": 2})
    telemetry(tmp_path / "telemetry", [(L4, 4.0, 1, 0.7)], [
        {"provider": "gcp", "region": "us-central1", "quota_name": "NVIDIA_L4_GPUS", "unit": "gpus", "limit": 8.0,
         "usage": 3.0, "covers": L4}])
    plan = plan_file(tmp_path / "plan.json", [(L4, 6)])
    code, out = cli(*apply_args(tmp_path, plan, cfg))
    assert code == 0 and "instanceGroupManagers.resize" not in env.gcp.changes
    code, out = cli(*apply_args(tmp_path, plan, cfg, "--apply"))
    assert code == 0 and "3 -> 5 (target 6): applied" in out
    ((path, _),) = env.gcp.changes["instanceGroupManagers.resize"]
    assert path.startswith("/compute/v1/projects/xroute-test/zones/us-central1-a/instanceGroupManagers/xroute-l4/resize?")
    assert "size=5" in path
    assert GcpAdapter({**FAST, "groups": [{"offering_id": L4, "group": "xroute-l4", "zone": "us-central1-a"}]}
                      ).inventory()[0].desired == 5


def test_a_group_config_error_from_the_command_names_the_field(env, tmp_path):
    cfg = config_file(tmp_path / "g.yaml", {"gcp": {"groups": [{"offering_id": L4, "model": MODEL, "group": "x"}]}},
                      {"max_usd_per_hour": 10, "max_step": 2})
    telemetry(tmp_path / "telemetry", [(L4, 4.0, 1, 0.7)], [])
    code, out = cli(*apply_args(tmp_path, plan_file(tmp_path / "plan.json", [(L4, 1)]), cfg))
    assert code == 2 and "provider_options.gcp.groups[0].zone: required for a gcp group" in out
