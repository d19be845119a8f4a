"""HTTP only: each module parses a resource's requests, calls a service or the engine, and renders the answer; no decision logic lives here."""
