"""Tenant quotas, read-only: ``GET /v1/quotas`` (the caller's tenant) and ``GET /v1/admin/quotas``
(every tenant; admin key) -- each bucket's limits and what it holds now (``router.decision.quotas``;
``docs/quotas.md``). The quotas themselves are set in the router settings
(``tenants.<name>.quotas``)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from router.http.deps import CallerDep, ReadQuotas
from router.service.services import Services
from xroute.schema.decision import ErrorResponse
from xroute.schema.quota import LIMITS, QuotaBucket

router = APIRouter(prefix="/v1", tags=["quotas"])


class BucketState(BaseModel):
    key: str = Field(description="the state's key of the bucket: t:<tenant> or m:<tenant>|<model>")
    scope: str = Field(description="'tenant' or 'tenant_model'")
    tenant: str
    model: str | None = None
    limits: dict[str, float | None] = Field(description="max_concurrent, tokens_per_minute, requests_per_day, "
                                                        "usd_per_day (null: no limit)")
    concurrent: int = Field(description="requests admitted and not yet reported or expired")
    tokens_window: int = Field(description="tokens of the requests admitted in the last 60 s")
    requests_day: int = Field(description="requests admitted in the current UTC day")
    usd_day: float = Field(description="USD of the requests admitted in the current UTC day (reserved, reconciled on "
                                       "feedback)")


class QuotasResponse(BaseModel):
    buckets: list[BucketState]


async def _buckets(svc: Services, tenants: list[str]) -> QuotasResponse:
    plan = svc.engine.quota_plan
    seen: dict[str, QuotaBucket] = {}
    for tenant in tenants:
        q = plan.quotas.get(tenant)
        if q is None:
            continue
        for model in ["", *q.models]:
            for b in plan.buckets(tenant, model):
                seen.setdefault(b.key, b)
    usage = (await svc.state.view(list(seen))).quotas if seen else {}
    out = []
    for key, b in seen.items():
        u = usage[key]
        out.append(BucketState(key=key, scope=b.scope, tenant=b.tenant, model=b.model,
                               limits={n: None if v < 0 else v for n, v in zip(LIMITS, b.limits)},
                               concurrent=u.concurrent, tokens_window=u.tokens_window, requests_day=u.requests_day,
                               usd_day=u.usd_day))
    return QuotasResponse(buckets=out)


@router.get("/quotas", response_model=QuotasResponse, summary="The caller's tenant quotas and their usage",
            responses={401: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})  # type: ignore[dict-item]
async def my_quotas(caller: CallerDep) -> QuotasResponse:
    return await _buckets(caller.svc, [caller.who.tenant])


@router.get("/admin/quotas", response_model=QuotasResponse, summary="Every tenant's quotas and their usage",
            tags=["admin"], responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},  # type: ignore[dict-item]
                                       503: {"model": ErrorResponse}})
async def all_quotas(caller: ReadQuotas) -> QuotasResponse:
    return await _buckets(caller.svc, sorted(caller.svc.engine.quota_plan.quotas))
