"""The online routing service (FastAPI): see docs/router.md."""
