"""``GET /v1/offerings``: the catalog with current prices, availability and the router's pool load."""

from __future__ import annotations

import time

from fastapi import APIRouter

from router.http.deps import CallerDep
from router.state.base import StateUnavailable
from xroute.schema.decision import ErrorResponse, OfferingsResponse

router = APIRouter(prefix="/v1", tags=["offerings"])


@router.get("/offerings", response_model=OfferingsResponse, responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}},  # type: ignore[dict-item]
            summary="Current state of every offering, and the known origins")
async def offerings(caller: CallerDep) -> dict[str, object]:
    try:
        reserved: dict[str, int] | None = (await caller.svc.state.view()).in_flight
    except StateUnavailable:
        reserved = None
    return caller.svc.engine.offerings_state(time.time(), reserved)
