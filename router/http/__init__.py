"""HTTP plumbing shared by ``api`` and ``gateway``: the caller's authentication (``deps``), the error shapes and handlers (``errors``), the request context middleware, the served-route class."""
