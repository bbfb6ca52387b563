"""Header and metadata names shared with Envoy and the Gateway API Inference Extension.

Every name that crosses the wire lives here, once.
"""

from __future__ import annotations

# The pick: request header and dynamic metadata (namespace, key); both must agree.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_KEY = DESTINATION_HEADER
# Proxy -> picker: the endpoint that actually served the request (after retries).
SERVED_KEY = "x-gateway-destination-endpoint-served"

# Proxy -> picker: restrict the pick to a subset of endpoints.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

# Error responses carry the reason in this header.
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"

# P/D disaggregation: the decode endpoint's sidecar calls this prefill endpoint first.
PREFILLER_HEADER = "x-prefiller-host-port"

# Request control headers read by the picker.
REQUEST_ID_HEADER = "x-request-id"
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
MODEL_REWRITE_HEADERS = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")

# Headers the client must never be able to set on the upstream request: the picker owns them.
PICKER_OWNED_HEADERS = frozenset({DESTINATION_HEADER, SERVED_KEY, SUBSET_KEY, PREFILLER_HEADER})

# Largest body chunk in one streamed body response (some Envoy builds cap chunks at 64 KiB).
BODY_CHUNK_LIMIT_BYTES = 62_000

# gRPC health service names answered as SERVING.
HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
