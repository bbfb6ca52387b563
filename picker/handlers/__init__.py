"""Envoy-facing handlers: the ext_proc stream state machine and request-body parsing."""
