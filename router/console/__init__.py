"""The web console (``/console``): what an operator looks at -- pools, decisions, policies, tenants,
the model -- server-rendered from Jinja2 templates (``templates/``), no script, no build step
(``docs/console.md``).

Contract:

- **Same keys, same roles** as the JSON API (``router.http.deps``): a page reads what the API route
  it mirrors would let the key read, through the same service and store calls. A key is presented
  as ``Authorization: Bearer`` / ``X-API-Key``, or -- for a browser -- the login form puts it in an
  ``HttpOnly``, ``SameSite=Strict`` cookie scoped to ``/console`` (``auth.py``). A tenant key sees
  its own tenant only (other tenants' decisions are "not found", tenant-wide pages 403); an
  auditor role (``admin:read:*``) sees everything and changes nothing.
- **Changes** are ``POST`` forms carrying a CSRF token derived from the key (``auth.csrf_token``):
  without it, 403; with it, the permission the JSON API checks for the same change.
- **Bounded reads**: every query has a ``LIMIT`` and walks an index from its start
  (``router.store.readers.search_decisions``: keyset pages, no ``OFFSET``, no count).
- **Bad input** to a query parameter or a form field is a 4xx in the API's error shape naming the
  field (``query.<name>``, ``body.<name>`` for a form field -- FastAPI's own names), never a 500.

Layering: above ``api`` (it calls the API modules' helpers -- the quota buckets, the dry run, the
state's status -- rather than copying them), below ``app`` (the factory mounts it).
"""
