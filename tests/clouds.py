"""Local stand-ins for the cloud APIs, for tests and the collection benchmark (loopback only).
Test scaffolding: it lives with the tests and is not part of the installed package.

:class:`FakeCloudServer` is a small threaded HTTP server that answers the real APIs' paths with
recorded payloads in their real wire format (JSON, EC2's XML), pages included, and can be told to
misbehave first (:class:`Fault`: 429 with Retry-After, 5xx, a stall past the client's timeout, a
truncated or malformed body, an answer swallowed after the request was carried out). It counts the
AWS query-protocol actions it sees (``actions``, those forwarded to moto included) and keeps the
bodies of the requests that change something (``changes``: PATCH, PUT, POST to a mutating route). Requests it has no route for are forwarded to ``proxy_to`` (moto's
server, for the AWS APIs moto implements) or answered 404.

Payloads live under ``tests/fixtures/cloud/<provider>/``; ``{{BASE}}``, ``{{REGION}}`` and
``{{ZONE}}`` in them are replaced by the server's URL and the region/zone asked for, so one
recorded region serves any region name.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.servers import free_port

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "cloud"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    #: the path with its query, as sent
    target: str = ""

    def q(self, name: str, default: str = "") -> str:
        return self.query.get(name, [default])[0]

    @property
    def form(self) -> dict[str, list[str]]:
        return parse_qs(self.body.decode(errors="replace"))

    def json(self) -> Any:
        return json.loads(self.body or b"{}")

    @property
    def aws_target(self) -> str:
        return self.headers.get("x-amz-target", "")

    @property
    def aws_region(self) -> str:
        m = re.search(r"Credential=[^/]+/\d+/([^/]+)/", self.headers.get("authorization", ""))
        return m.group(1) if m else "us-east-1"


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Fault:
    """One misbehaviour, served instead of the normal answer to one request."""

    kind: str  # status | stall | truncate | malformed | swallow | pass
    status: int = 500
    retry_after: float | None = None
    delay_s: float = 0.0

    @classmethod
    def throttle(cls, retry_after: float | None = 1.0, status: int = 429) -> Fault:
        return cls("status", status=status, retry_after=retry_after)

    @classmethod
    def error(cls, status: int = 503) -> Fault:
        return cls("status", status=status)

    @classmethod
    def stall(cls, delay_s: float) -> Fault:
        """Answer normally, but only after ``delay_s`` (longer than the client's timeout)."""
        return cls("stall", delay_s=delay_s)

    @classmethod
    def truncate(cls) -> Fault:
        """Promise the full body, send a third of it, close the connection."""
        return cls("truncate")

    @classmethod
    def swallow(cls, delay_s: float = 60.0) -> Fault:
        """Carry the request out (answer it internally, forward it to moto), then send nothing back
        for ``delay_s`` and close the connection: the client never learns it was done."""
        return cls("swallow", delay_s=delay_s)

    @classmethod
    def passing(cls) -> Fault:
        """Answer normally (a place holder, to fault a later request of the route)."""
        return cls("pass")

    @classmethod
    def malformed(cls) -> Fault:
        """A 200 whose body is cut in the middle of the JSON/XML (but complete as HTTP)."""
        return cls("malformed")


@dataclass
class Route:
    name: str
    match: Callable[[Request], bool]
    respond: Callable[[Request, FakeCloudServer], Response]


class FakeCloudServer:
    """A threaded loopback HTTP server with routes, scripted faults and hit counters."""

    def __init__(self, name: str, routes: list[Route] | None = None, proxy_to: str | None = None):
        self.name = name
        self.routes: list[Route] = list(routes or [])
        self.proxy_to = proxy_to
        self.hits: Counter[str] = Counter()
        self.log: list[tuple[str, str, str]] = []
        #: AWS query-protocol actions received (``Action=...``), forwarded ones included
        self.actions: Counter[str] = Counter()
        #: per route, the bodies of the requests that change something (PATCH, PUT, or a route in ``mutating``)
        self.changes: dict[str, list[tuple[str, bytes]]] = {}
        self.mutating: set[str] = set()
        #: a stand-in's own state (e.g. a scale set's capacity after a PATCH), cleared by reset()
        self.state: dict[str, Any] = {}
        self._faults: dict[str, list[Fault]] = {}
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def inject(self, route: str, *faults: Fault) -> None:
        """Serve ``faults`` (in order) to the next requests of ``route``, then answer normally."""
        if route != "*" and route not in {r.name for r in self.routes}:
            raise KeyError(f"{self.name} has no route '{route}'")
        with self._lock:
            self._faults.setdefault(route, []).extend(faults)

    def reset(self) -> None:
        with self._lock:
            self._faults.clear()
            self.hits.clear()
            self.log.clear()
            self.actions.clear()
            self.changes.clear()
            self.state.clear()

    @property
    def total_hits(self) -> int:
        return sum(self.hits.values())

    def _next_fault(self, route: str) -> Fault | None:
        with self._lock:
            for key in (route, "*"):
                q = self._faults.get(key)
                if q:
                    return q.pop(0)
        return None

    def start(self) -> FakeCloudServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                parts = urlsplit(self.path)
                req = Request(self.command, parts.path, parse_qs(parts.query, keep_blank_values=True),
                              {k.lower(): v for k, v in self.headers.items()}, body, self.path)
                route = next((r for r in server.routes if r.match(req)), None)
                name = route.name if route else "proxy" if server.proxy_to else "404"
                action = req.form.get("Action", [""])[0] if req.method == "POST" and b"Action=" in body else ""
                with server._lock:
                    server.hits[name] += 1
                    server.log.append((name, req.method, self.path))
                    if action:
                        server.actions[action] += 1
                    if route is not None and (req.method in ("PATCH", "PUT") or route.name in server.mutating):
                        server.changes.setdefault(route.name, []).append((self.path, body))
                if route is None:
                    resp = server.forward(req) if server.proxy_to else Response(
                        404, json.dumps({"error": {"code": "NotFound", "message": f"no route for {req.path}"}}).encode())
                    self._send(resp)
                    return
                fault = server._next_fault(route.name)
                if fault is not None and fault.kind == "status":
                    headers = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else {}
                    xml = route.name in _XML_ROUTES
                    self._send(Response(fault.status, _error_body(xml, fault.status), headers=headers,
                                        content_type="text/xml" if xml else "application/json"))
                    return
                if fault is not None and fault.kind == "stall":
                    time.sleep(fault.delay_s)
                resp = route.respond(req, server)
                if fault is not None and fault.kind == "swallow":
                    time.sleep(fault.delay_s)
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None and fault.kind == "malformed":
                    resp.body = resp.body[: max(1, len(resp.body) // 2)]
                if fault is not None and fault.kind == "truncate":
                    self.send_response(resp.status)
                    self.send_header("Content-Type", resp.content_type)
                    self.send_header("Content-Length", str(len(resp.body)))
                    self.end_headers()
                    self.wfile.write(resp.body[: len(resp.body) // 3])
                    self.wfile.flush()
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._send(resp)

            def _send(self, resp: Response) -> None:
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.content_type)
                self.send_header("Content-Length", str(len(resp.body)))
                for k, v in resp.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(resp.body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=f"fake-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeCloudServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def forward(self, req: Request) -> Response:
        """``req`` forwarded to ``proxy_to`` (moto's server) and its answer."""
        assert self.proxy_to is not None
        target = urlsplit(self.proxy_to)
        conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=30)
        try:
            headers = {k: v for k, v in req.headers.items() if k not in ("host", "connection")}
            conn.request(req.method, req.target, body=req.body, headers=headers)
            r = conn.getresponse()
            body = r.read()
            skip = {"content-length", "transfer-encoding", "connection", "content-type", "server", "date"}
            return Response(r.status, body, r.getheader("content-type") or "application/octet-stream",
                            {k: v for k, v in r.getheaders() if k.lower() not in skip})
        finally:
            conn.close()


_XML_ROUTES = {"DescribeSpotPriceHistory", "GetSpotPlacementScores"}


def _error_body(xml: bool, status: int) -> bytes:
    if xml:
        code = "RequestLimitExceeded" if status == 429 else "InternalError"
        return (f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{code}</Code>'
                f"<Message>injected {status}</Message></Error></Errors><RequestID>fault</RequestID></Response>").encode()
    code = {429: "TooManyRequests", 500: "InternalServerError", 503: "ServiceUnavailable"}.get(status, "Error")
    return json.dumps({"error": {"code": code, "message": f"injected {status}"}, "__type": code,
                       "message": f"injected {status}"}).encode()


# -- recorded payloads -------------------------------------------------------------------------------


def render(path: Path, server: FakeCloudServer, **subs: str) -> bytes:
    """A recorded payload with ``{{BASE}}``, ``{{REGION}}``, ``{{ZONE}}`` filled in."""
    text = path.read_text()
    text = text.replace("{{BASE}}", server.url)
    for k, v in subs.items():
        text = text.replace("{{" + k.upper() + "}}", v)
    return text.encode()


def pages(fixtures: Path, stem: str, suffix: str = ".json") -> list[Path]:
    """``stem.page1.json``, ``stem.page2.json``, ... or just ``stem.json``."""
    found = sorted(fixtures.glob(f"{stem}.page*{suffix}"), key=lambda p: int(re.findall(r"page(\d+)", p.name)[-1]))
    return found or [fixtures / f"{stem}{suffix}"]


def page_index(token: str) -> int:
    """Page tokens in the recordings end in ``page<N>`` (``...page2``); no token is page 1."""
    m = re.search(r"page(\d+)$", token or "")
    return int(m.group(1)) - 1 if m else 0


def _paged(files: list[Path], token: str, server: FakeCloudServer, content_type: str = "application/json",
           **subs: str) -> Response:
    i = page_index(token)
    if i >= len(files):
        return Response(400, json.dumps({"error": {"code": "InvalidToken", "message": "bad page token"}}).encode())
    return Response(200, render(files[i], server, **subs), content_type)


def aws_server(fixtures: Path = FIXTURES, proxy_to: str | None = None) -> FakeCloudServer:
    """The AWS APIs moto lacks: Price List ``GetProducts``, Service Quotas ``ListServiceQuotas``,
    EC2 ``DescribeSpotPriceHistory`` (real prices, paged) and ``GetSpotPlacementScores``."""
    d = fixtures / "aws"
    scores = json.loads((d / "spot_placement_scores.json").read_text())

    def products(req: Request, s: FakeCloudServer) -> Response:
        body = req.json()
        region = next((f["Value"] for f in body.get("Filters", []) if f["Field"] == "regionCode"), "us-east-1")
        return _paged(pages(d, "pricing_get_products"), body.get("NextToken", ""), s, "application/x-amz-json-1.1",
                      region=region)

    def quotas(req: Request, s: FakeCloudServer) -> Response:
        return _paged(pages(d, "service_quotas_ec2"), req.json().get("NextToken", ""), s,
                      "application/x-amz-json-1.1", region=req.aws_region)

    def spot_history(req: Request, s: FakeCloudServer) -> Response:
        return _paged(pages(d, "spot_price_history", ".xml"), req.form.get("NextToken", [""])[0], s,
                      "text/xml", region=req.aws_region)

    def placement(req: Request, s: FakeCloudServer) -> Response:
        itype = req.form.get("InstanceType.1", [""])[0]
        region = req.form.get("RegionName.1", [req.aws_region])[0]
        body = render(d / "spot_placement_scores.xml", s, region=region).replace(
            b"{{SCORE}}", str(scores.get(itype, 1)).encode())
        return Response(200, body, "text/xml")

    def ec2_action(action: str) -> Callable[[Request], bool]:
        return lambda r: r.method == "POST" and r.form.get("Action", [""])[0] == action

    srv = FakeCloudServer("aws", [
        Route("GetProducts", lambda r: r.aws_target == "AWSPriceListService.GetProducts", products),
        Route("ListServiceQuotas", lambda r: r.aws_target == "ServiceQuotasV20190624.ListServiceQuotas", quotas),
        Route("DescribeSpotPriceHistory", ec2_action("DescribeSpotPriceHistory"), spot_history),
        Route("GetSpotPlacementScores", ec2_action("GetSpotPlacementScores"), placement),
        # Auto Scaling's resize is moto's; a route of its own so faults can be injected into it
        Route("SetDesiredCapacity", ec2_action("SetDesiredCapacity"), lambda r, s: s.forward(r)),
    ], proxy_to=proxy_to)
    srv.mutating.add("SetDesiredCapacity")
    return srv


def azure_server(fixtures: Path = FIXTURES) -> FakeCloudServer:
    """ARM ``Microsoft.Compute/skus`` and ``locations/{loc}/usages``, and the Retail Prices API."""
    d = fixtures / "azure"

    def skus(req: Request, s: FakeCloudServer) -> Response:
        m = re.search(r"location eq '([^']+)'", req.q("$filter"))
        return _paged(pages(d, "resource_skus"), req.q("$skiptoken"), s, region=m.group(1) if m else "eastus")

    def usages(req: Request, s: FakeCloudServer) -> Response:
        loc = req.path.rstrip("/").split("/")[-2]
        return _paged(pages(d, "usages"), req.q("$skiptoken"), s, region=loc)

    def prices(req: Request, s: FakeCloudServer) -> Response:
        m = re.search(r"armRegionName eq '([^']+)'", req.q("$filter"))
        skip = req.q("$skip")
        return _paged(pages(d, "retail_prices"), f"page{int(skip) // 1000 + 1}" if skip else "", s,
                      region=m.group(1) if m else "eastus")

    vmss_path = re.compile(r"/subscriptions/[^/]+/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft\.Compute/"
                           r"virtualMachineScaleSets/(?P<name>[^/]+)(?P<vms>/virtualMachines)?")

    def vmss(req: Request, s: FakeCloudServer) -> Response:
        """A scale set (the recorded one, under the asked name): its capacity is the stand-in's, which
        a PATCH of ``sku.capacity`` changes."""
        m = vmss_path.fullmatch(req.path)
        assert m is not None
        rg, name = m.group("rg"), m.group("name")
        body = json.loads(render(d / "vmss.json", s, rg=rg, name=name))
        key = f"vmss/{rg}/{name}"
        if req.method == "PATCH":
            s.state[key] = int(req.json()["sku"]["capacity"])
            body["properties"]["provisioningState"] = "Updating"
        body["sku"]["capacity"] = s.state.get(key, body["sku"]["capacity"])
        return Response(200, json.dumps(body).encode(), headers={
            "Azure-AsyncOperation": f"{s.url}/subscriptions/x/providers/Microsoft.Compute/locations/eastus/operations/"
                                    "5d8f1b2c-1f0e-4c47-9a8e-3c9d9c2b7a41?api-version=2024-07-01"}
                        if req.method == "PATCH" else {})

    def vmss_vms(req: Request, s: FakeCloudServer) -> Response:
        m = vmss_path.fullmatch(req.path)
        assert m is not None
        return Response(200, render(d / "vmss_vms.json", s, rg=m.group("rg"), name=m.group("name")))

    return FakeCloudServer("azure", [
        Route("resource_skus", lambda r: r.path.endswith("/providers/Microsoft.Compute/skus"), skus),
        Route("usages", lambda r: "/providers/Microsoft.Compute/locations/" in r.path and r.path.endswith("/usages"), usages),
        Route("retail_prices", lambda r: r.path == "/api/retail/prices", prices),
        Route("vmss_vms", lambda r: bool((m := vmss_path.fullmatch(r.path)) and m.group("vms")), vmss_vms),
        Route("vmss", lambda r: bool((m := vmss_path.fullmatch(r.path)) and not m.group("vms")), vmss),
    ])


def gcp_server(fixtures: Path = FIXTURES) -> FakeCloudServer:
    """Compute Engine ``regions.get``, ``machineTypes.list``, ``acceleratorTypes.list``, the
    Cloud Billing Catalog ``services.skus.list`` and Cloud Monitoring ``timeSeries.list``."""
    d = fixtures / "gcp"

    def region(req: Request, s: FakeCloudServer) -> Response:
        name = req.path.rstrip("/").split("/")[-1]
        return Response(200, render(d / "region.json", s, region=name))

    def zonal(stem: str) -> Callable[[Request, FakeCloudServer], Response]:
        def respond(req: Request, s: FakeCloudServer) -> Response:
            zone = req.path.split("/zones/")[1].split("/")[0]
            letter = zone.rsplit("-", 1)[-1]
            files = pages(d, f"{stem}_{letter}")
            if not files[0].exists():
                files = pages(d, f"{stem}_a")
            return _paged(files, req.q("pageToken"), s, region=zone.rsplit("-", 1)[0], zone=zone)
        return respond

    def skus(req: Request, s: FakeCloudServer) -> Response:
        return _paged(pages(d, "billing_skus"), req.q("pageToken"), s)

    def time_series(req: Request, s: FakeCloudServer) -> Response:
        stem = "monitoring_gpu" if "gpu" in req.q("filter") else "monitoring_cpu"
        return _paged(pages(d, stem), req.q("pageToken"), s)

    mig_path = re.compile(r"/compute/v1/projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instanceGroupManagers/"
                          r"(?P<name>[^/]+)(?P<resize>/resize)?")

    def mig(req: Request, s: FakeCloudServer) -> Response:
        """A managed instance group (the recorded one, under the asked name); its targetSize is the
        stand-in's, which a resize changes."""
        m = mig_path.fullmatch(req.path)
        assert m is not None
        subs = {"project": m.group("project"), "zone": m.group("zone"), "name": m.group("name")}
        key = f"mig/{m.group('zone')}/{m.group('name')}"
        if m.group("resize"):
            s.state[key] = int(req.q("size"))
            return Response(200, render(d / "mig_resize_operation.json", s, **subs))
        body = json.loads(render(d / "instance_group_manager.json", s, **subs))
        body["targetSize"] = s.state.get(key, body["targetSize"])
        return Response(200, json.dumps(body).encode())

    srv = FakeCloudServer("gcp", [
        Route("regions.get", lambda r: re.fullmatch(r"/compute/v1/projects/[^/]+/regions/[^/]+", r.path) is not None, region),
        Route("machineTypes.list", lambda r: r.path.endswith("/machineTypes"), zonal("machine_types")),
        Route("acceleratorTypes.list", lambda r: r.path.endswith("/acceleratorTypes"), zonal("accelerator_types")),
        Route("skus.list", lambda r: r.path.startswith("/v1/services/") and r.path.endswith("/skus"), skus),
        Route("timeSeries.list", lambda r: r.path.startswith("/v3/projects/") and r.path.endswith("/timeSeries"),
              time_series),
        Route("instanceGroupManagers.resize", lambda r: r.method == "POST" and bool(
            (m := mig_path.fullmatch(r.path)) and m.group("resize")), mig),
        Route("instanceGroupManagers.get", lambda r: r.method == "GET" and bool(
            (m := mig_path.fullmatch(r.path)) and not m.group("resize")), mig),
    ])
    srv.mutating.add("instanceGroupManagers.resize")
    return srv


def prometheus_server(fixtures: Path = FIXTURES) -> FakeCloudServer:
    """Prometheus' HTTP API ``/api/v1/query_range`` with recorded DCGM exporter answers."""
    d = fixtures / "prometheus"

    def query_range(req: Request, s: FakeCloudServer) -> Response:
        q = req.q("query") or req.form.get("query", [""])[0]
        stem = "query_range_gpu" if "DCGM_FI_DEV_GPU_UTIL" in q else "query_range_cpu"
        return Response(200, render(d / f"{stem}.json", s))

    return FakeCloudServer("prometheus", [Route("query_range", lambda r: r.path == "/api/v1/query_range", query_range)])


# -- everything at once ------------------------------------------------------------------------------

_MOTO: dict[str, Any] = {}
_MOTO_LOCK = threading.Lock()


def moto_url() -> str:
    """moto's server on a free loopback port, started once per process (stopped at exit)."""
    with _MOTO_LOCK:
        if "url" not in _MOTO:
            import atexit

            from moto.server import ThreadedMotoServer

            port = free_port()
            srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            srv.start()
            atexit.register(srv.stop)
            _MOTO.update(server=srv, url=f"http://127.0.0.1:{port}")
        return str(_MOTO["url"])


FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@dataclass
class LocalClouds:
    """The three providers' local servers (AWS in front of moto) and the environment that points
    the adapters at them."""

    aws: FakeCloudServer
    azure: FakeCloudServer
    gcp: FakeCloudServer
    prometheus: FakeCloudServer

    @property
    def env(self) -> dict[str, str]:
        return {
            **FAKE_AWS_ENV,
            "XROUTE_AWS_ENDPOINT_URL": self.aws.url,
            "XROUTE_AZURE_ENDPOINT": self.azure.url,
            "XROUTE_AZURE_CREDENTIALS": "anonymous",
            "AZURE_SUBSCRIPTION_ID": "00000000-0000-0000-0000-000000000000",
            "XROUTE_GCP_ENDPOINT": self.gcp.url,
            "XROUTE_GCP_CREDENTIALS": "anonymous",
            "GOOGLE_CLOUD_PROJECT": "xroute-test",
        }

    @property
    def servers(self) -> list[FakeCloudServer]:
        return [self.aws, self.azure, self.gcp, self.prometheus]

    def reset(self) -> None:
        for s in self.servers:
            s.reset()


@contextlib.contextmanager
def local_clouds(fixtures: Path = FIXTURES, *, with_moto: bool = True) -> Iterator[LocalClouds]:
    """Start all local servers; yields :class:`LocalClouds`. Sets no environment itself."""
    clouds = LocalClouds(aws_server(fixtures, proxy_to=moto_url() if with_moto else None).start(),
                         azure_server(fixtures).start(), gcp_server(fixtures).start(), prometheus_server(fixtures).start())
    try:
        yield clouds
    finally:
        for s in clouds.servers:
            s.stop()
