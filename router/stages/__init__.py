"""The request path of one router replica, one stage per module, one `RequestContext` passed
along (context.py). Both edges (gRPC: router/grpc_service.py, HTTP: router/openai_http.py)
decode their request into an `InboundRequest` and call `RouterCore.start`, which runs:

    InboundRequest ──> RequestContext
      authenticate   API key -> Tenant                                  authenticate.py
      validate       rules, adapter, sampling, tokenize, context fit;   validate.py
                     the worker's GenerateRequest and its RequestBudget
                     (prompt, max_tokens x n, KV tokens), computed once
      quota          the tenant's limits and token buckets reserve      quota.py
                     budget.prompt_tokens + budget.output_tokens
      degrade        the degradation ladder: as sent, queued, capped,   degrade.py
                     on the fallback pool, or refused
      admit/route    KV budget on some worker (router/admission.py),    admit_route.py
                     the routing policy among those with room
      stream         RequestStream: the worker's deltas, deadline,      stream.py
                     re-route / resumption, settlement on every exit
    <── RequestStream

Each stage raises a `kvmesh.core.errors` type when the request stops there; the edges map it
with router/status_map.py. What a stage holds (a quota reservation, an admission ticket) is
given back by RouterCore.start if a later stage refuses, and by the stream once it runs.

The budget travels to the worker inside the GenerateRequest (`budget`); the engine checks it
against the request it serves and refuses a mismatch (worker/engine_loop/engine.py,
`request_budget`). docs/engine.md, "A request's max_tokens", follows one value end to end.
"""
