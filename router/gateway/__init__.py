"""The OpenAI-compatible gateway: ``POST /v1/chat/completions`` and ``/v1/completions`` (streamed
and not) and ``GET /v1/models``, routed by the router's own decision path, forwarded to the chosen
pool's inference servers, measured, and fed back into the closed loop (``docs/gateway.md``).

Modules: the HTTP routes (``routes``), the request path -- deciding, forwarding, retrying,
closing the loop (``service``), one attempt's exchange with a server and what it measured
(``exchange``), the servers, their keys, the HTTP client and the per-phase guard (``upstream``),
the OpenAI API's bodies, errors and events (``openai_api``), prompt-token counting (``tokens``),
and the opt-in transcript store (``transcripts``)."""
