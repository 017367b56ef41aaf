"""What a server did and what clients ask of it: the telemetry records, traces and workloads.

* :mod:`env.traces.schema`: ``StepRecord`` / ``RequestRecord``, the field names shared by the
  trace format and the controller's wire protocol;
* :mod:`env.traces.trace_format`: the Parquet trace format (read, write, validate);
* :mod:`env.traces.workloads`: request arrivals (open loop) and closed-loop clients, with the
  shipped public traces under ``data/``.

It imports nothing else from ``env``: the simulator, the controller and the SGLang plugin
all build on it.
"""
