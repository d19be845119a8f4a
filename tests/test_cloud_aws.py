"""The AWS adapter with real boto3 clients against moto's server and recorded AWS payloads.

moto (server mode, loopback) answers EC2 DescribeInstanceTypes/Offerings/Instances and CloudWatch;
a local server in front of it answers, in AWS's wire format, what moto lacks: the Price List API,
Service Quotas, real spot price history (paged) and spot placement scores.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import time
from datetime import UTC, datetime, timedelta

import boto3
import pytest

from cloud_adapters.aws import AwsAdapter
from cloud_adapters.base import PoolSelector
from cloud_adapters.errors import CloudAuthError, CloudResponseError, CloudThrottledError, CloudUnavailableError
from tests.clouds import FAKE_AWS_ENV, FIXTURES, Fault, aws_server, local_clouds, moto_url

logging.getLogger("werkzeug").setLevel(logging.ERROR)
FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 2.0}


@pytest.fixture(scope="module")
def clouds():
    with local_clouds() as c:
        yield c


@pytest.fixture
def aws(clouds, monkeypatch):
    clouds.reset()
    for k, v in clouds.env.items():
        monkeypatch.setenv(k, v)
    return clouds.aws


def adapter(**cfg) -> AwsAdapter:
    return AwsAdapter({**FAST, **cfg})


def test_offerings_come_from_describe_instance_types_filtered_to_the_region(aws):
    offers = {o.instance_type: o for o in adapter().offerings("eu-west-1")}
    assert offers["g5.xlarge"].accelerator == "A10G" and offers["g5.xlarge"].accelerator_count == 1
    assert offers["g5.xlarge"].vcpus == 4 and offers["g5.xlarge"].memory_gib == 16
    assert offers["p4d.24xlarge"].accelerator_count == 8
    assert "g6.xlarge" not in offers  # moto's catalog: not offered in eu-west-1
    assert all(o.accelerator_count > 0 for o in offers.values())
    # DescribeInstanceTypes + DescribeInstanceTypeOfferings, served by moto (a loaded machine can
    # break a connection, which the adapter rightly retries: at least two, never none)
    assert aws.hits["proxy"] >= 2


def test_explicit_instance_types(aws):
    offers = adapter(instance_types=["g4dn.xlarge", "p5.48xlarge"]).offerings("us-east-1")
    assert [o.instance_type for o in offers] == ["g4dn.xlarge", "p5.48xlarge"]
    assert offers[1].accelerator == "H100"


def test_on_demand_prices_read_every_page_of_the_price_list(aws):
    prices = {p.instance_type: p for p in adapter().on_demand_prices("us-west-2", ["g5.xlarge", "p5.48xlarge", "x9.huge"])}
    assert prices["g5.xlarge"].usd_per_hour == pytest.approx(1.006)
    assert prices["p5.48xlarge"].usd_per_hour == pytest.approx(98.32)  # on the second page
    assert "x9.huge" not in prices
    assert prices["g5.xlarge"].ts == datetime(2024, 5, 1, tzinfo=UTC)
    assert prices["g5.xlarge"].offering_id == "aws:us-west-2:g5.xlarge:on_demand"
    assert aws.hits["GetProducts"] == 2


def test_spot_price_history_is_paged_and_merged_to_the_cheapest_zone(aws):
    since = datetime(2024, 5, 1, tzinfo=UTC)
    pts = adapter().spot_prices("us-east-1", ["g5.xlarge", "g4dn.xlarge"], since=since)
    assert aws.hits["DescribeSpotPriceHistory"] == 2
    g5 = [p for p in pts if p.instance_type == "g5.xlarge"]
    assert len(g5) > 3 and all(not p.snapshot for p in g5)
    assert [p.ts for p in g5] == sorted(p.ts for p in g5)
    assert all(0.3 < p.usd_per_hour < 0.6 for p in g5)
    assert all(a.usd_per_hour != b.usd_per_hour for a, b in itertools.pairwise(g5))


def test_moto_spot_price_history_placeholder_is_read_as_is(monkeypatch):
    """Straight to moto (no recorded payloads): its placeholder answer parses like a real one."""
    for k, v in FAKE_AWS_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("XROUTE_AWS_ENDPOINT_URL", moto_url())
    pts = adapter().spot_prices("us-east-1", ["g5.xlarge"], since=None)
    assert pts and pts[0].usd_per_hour == pytest.approx(0.00001) and pts[0].snapshot


def test_spot_placement_scores_become_availability(aws):
    a = adapter(spot_placement_scores=True, placement_score_threshold=5)
    got = {s.instance_type: s for s in a.spot_availability("us-east-1", ["g5.xlarge", "p4d.24xlarge"])}
    assert got["g5.xlarge"].available and "7/10" in got["g5.xlarge"].detail
    assert not got["p4d.24xlarge"].available
    assert got["g5.xlarge"].offering_id == "aws:us-east-1:g5.xlarge:spot"


def test_quotas_keep_gpu_vcpu_classes_with_usage_from_cloudwatch(aws):
    cw = boto3.client("cloudwatch", region_name="us-east-1", endpoint_url=moto_url())
    cw.put_metric_data(Namespace="AWS/Usage", MetricData=[{
        "MetricName": "ResourceCount", "Value": 8.0, "Timestamp": datetime.now(UTC) - timedelta(minutes=2),
        "Dimensions": [{"Name": "Class", "Value": "G/OnDemand"}, {"Name": "Resource", "Value": "vCPU"},
                       {"Name": "Service", "Value": "EC2"}, {"Name": "Type", "Value": "Resource"}]}])
    q = {r.quota_name: r for r in adapter().quotas("us-east-1")}
    assert set(q) == {"Running On-Demand G and VT instances", "Running On-Demand P instances",
                      "All G and VT Spot Instance Requests", "All P4, P3 and P2 Spot Instance Requests"}
    g = q["Running On-Demand G and VT instances"]
    assert g.limit == 64 and g.unit == "vcpus" and g.usage == 8.0
    assert q["Running On-Demand P instances"].usage is None
    # what each counts (the env and the router mask offerings a quota leaves no room for: envs.capacity)
    assert g.covers == ("aws:us-east-1:g*:on_demand",)
    assert q["All P4, P3 and P2 Spot Instance Requests"].covers == ("aws:us-east-1:p*:spot",)
    assert aws.hits["ListServiceQuotas"] == 2


def test_utilization_of_a_tagged_pool_from_cloudwatch(aws):
    ec2 = boto3.client("ec2", region_name="us-west-2", endpoint_url=moto_url())
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    tag = [{"ResourceType": "instance", "Tags": [{"Key": "xroute-pool", "Value": "g5-west"}]}]
    ids = [i["InstanceId"] for i in ec2.run_instances(ImageId=ami, InstanceType="g5.xlarge", MinCount=2, MaxCount=2,
                                                       TagSpecifications=tag)["Instances"]]
    ec2.run_instances(ImageId=ami, InstanceType="g5.xlarge", MinCount=1, MaxCount=1)  # untagged: not in the pool
    cw = boto3.client("cloudwatch", region_name="us-west-2", endpoint_url=moto_url())
    t = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=10)
    for iid, gpu, cpu in zip(ids, (40.0, 80.0), (10.0, 30.0), strict=True):
        dims = [{"Name": "InstanceId", "Value": iid}]
        cw.put_metric_data(Namespace="CWAgent", MetricData=[
            {"MetricName": "nvidia_smi_utilization_gpu", "Value": gpu, "Timestamp": t, "Dimensions": dims}])
        cw.put_metric_data(Namespace="AWS/EC2", MetricData=[
            {"MetricName": "CPUUtilization", "Value": cpu, "Timestamp": t, "Dimensions": dims}])
    pool = PoolSelector(offering_id="aws:us-west-2:g5.xlarge:on_demand", source="aws", region="us-west-2",
                        tags={"xroute-pool": "g5-west"})
    samples = adapter().utilization(pool, t - timedelta(minutes=5), t + timedelta(minutes=5))
    assert len(samples) == 1
    assert samples[0].gpu_util == pytest.approx(0.6) and samples[0].cpu_util == pytest.approx(0.2)
    assert samples[0].offering_id == pool.offering_id


def test_throttling_is_retried_after_retry_after(aws):
    aws.inject("GetProducts", Fault.throttle(retry_after=0.3))
    a = adapter()
    t0 = time.monotonic()
    prices = a.on_demand_prices("us-east-1", ["g5.xlarge"])
    assert time.monotonic() - t0 >= 0.3
    assert prices and aws.hits["GetProducts"] == 3  # the 429, then both recorded pages
    assert a.stats.retries["GetProducts"] == 1


def test_server_errors_are_retried_by_us_not_by_botocore(aws):
    aws.inject("ListServiceQuotas", Fault.error(503), Fault.error(500))
    a = adapter()
    assert a.quotas("eu-west-1")
    assert a.stats.retries["ListServiceQuotas"] == 2
    assert aws.hits["ListServiceQuotas"] == 4  # two failures, then both pages: botocore itself retried nothing


def test_truncated_json_body_ends_in_an_error_naming_the_field(aws):
    # botocore reads a cut JSON body as an empty answer; the missing field is what we can name
    aws.inject("ListServiceQuotas", Fault.truncate())
    with pytest.raises(CloudResponseError) as e:
        adapter().quotas("eu-west-1")
    assert str(e.value) == "aws eu-west-1 ListServiceQuotas: missing in the response (field 'Quotas')"


def test_truncated_xml_body_ends_in_a_clear_error(aws):
    aws.inject("DescribeSpotPriceHistory", Fault.truncate())
    with pytest.raises((CloudResponseError, CloudUnavailableError), match="aws us-east-1 DescribeSpotPriceHistory"):
        adapter(max_attempts=1).spot_prices("us-east-1", ["g5.xlarge"], since=datetime(2024, 5, 1, tzinfo=UTC))


def test_ec2_errors_in_xml_are_retried(aws):
    aws.inject("DescribeSpotPriceHistory", Fault.error(500))
    a = adapter()
    assert a.spot_prices("us-east-1", ["g5.xlarge"], since=datetime(2024, 5, 1, tzinfo=UTC))
    assert a.stats.retries["DescribeSpotPriceHistory"] == 1


def test_stalled_answers_time_out_and_are_retried(aws):
    aws.inject("GetSpotPlacementScores", Fault.stall(1.5))
    a = adapter(spot_placement_scores=True, timeout_s=0.5)
    assert a.spot_availability("us-east-1", ["g5.xlarge"])
    assert a.stats.retries["GetSpotPlacementScores"] == 1


def test_persistent_throttling_ends_in_a_clear_error(aws):
    aws.inject("GetProducts", *[Fault.throttle(retry_after=0)] * 3)
    with pytest.raises(CloudThrottledError) as e:
        adapter(max_attempts=3).on_demand_prices("ap-south-1", ["g5.xlarge"])
    assert str(e.value).startswith("aws ap-south-1 GetProducts:")


def test_persistent_5xx_ends_in_unavailable(aws):
    aws.inject("ListServiceQuotas", *[Fault.error(503)] * 2)
    with pytest.raises(CloudUnavailableError, match="aws us-east-1 ListServiceQuotas"):
        adapter(max_attempts=2).quotas("us-east-1")


def test_access_denied_names_the_iam_action(aws):
    aws.inject("GetProducts", Fault.error(403))
    with pytest.raises(CloudAuthError) as e:
        adapter().on_demand_prices("us-east-1", ["g5.xlarge"])
    assert "pricing:GetProducts" in str(e.value)
    assert not isinstance(e.value.__cause__, CloudAuthError)  # chained from botocore's error


def test_malformed_body_is_a_clear_error(aws):
    aws.inject("GetProducts", Fault.malformed())
    with pytest.raises(CloudResponseError) as e:
        adapter().on_demand_prices("us-east-1", ["g5.xlarge"])
    assert "aws us-east-1 GetProducts" in str(e.value)


def test_missing_field_is_named(aws, tmp_path):
    fx = tmp_path / "fx"
    shutil.copytree(FIXTURES, fx)
    p = fx / "aws" / "pricing_get_products.page1.json"
    p.write_text(p.read_text().replace('\\"pricePerUnit\\":{\\"USD\\":\\"1.0060000000\\"}', '\\"pricePerUnit\\":{}'))
    with aws_server(fx) as srv:
        os.environ["XROUTE_AWS_ENDPOINT_URL_PRICING"] = srv.url
        try:
            with pytest.raises(CloudResponseError) as e:
                adapter().on_demand_prices("us-east-1", ["g5.xlarge"])
        finally:
            del os.environ["XROUTE_AWS_ENDPOINT_URL_PRICING"]
    assert "pricePerUnit.USD" in e.value.field and e.value.field.startswith("PriceList[")


def test_no_credentials_is_an_auth_error(aws, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k)
    with pytest.raises(CloudAuthError, match=r"standard chain|credentials"):
        adapter().quotas("us-east-1")


def test_api_endpoint_is_the_regional_ec2_host_unless_overridden(monkeypatch):
    monkeypatch.delenv("XROUTE_AWS_ENDPOINT_URL", raising=False)
    assert adapter().api_endpoint("eu-west-1") == ("ec2.eu-west-1.amazonaws.com", 443)
    monkeypatch.setenv("XROUTE_AWS_ENDPOINT_URL", "http://127.0.0.1:5000")
    assert adapter().api_endpoint("eu-west-1") == ("127.0.0.1", 5000)


def test_sdk_errors_raised_outside_a_call_are_translated_too(aws):
    from cloud_adapters.errors import CloudError

    with pytest.raises(CloudError) as e:
        adapter(profile="no-such-profile").offerings("us-east-1")
    assert "ProfileNotFound" in str(e.value) and str(e.value).startswith("aws us-east-1 offerings:")
    assert type(e.value).__module__ == "cloud_adapters.errors"
