"""The simulator of an SGLang server running speculative decoding, and what calibrates it.

* :mod:`env.sim.simulator`: the continuous-batching scheduler, one decode step at a time;
* :mod:`env.sim.cost_model`: what a step costs (:class:`~env.sim.cost_model.CostProfile`),
  the shipped profiles (``profiles/``) and the least-squares fits;
* :mod:`env.sim.off_cost`, :mod:`env.sim.load_fit`: the off-path and under-load terms,
  fitted to H200 measurements;
* :mod:`env.sim.acceptance`: how many drafts a request accepts at each position;
* :mod:`env.sim.random_servers`: randomised servers for training;
* :mod:`env.sim.calibration`: how the shipped profiles were fitted (one module per profile
  family); :mod:`env.sim.fit_profile`: ``specctl-fit-profile``, a profile from a recorded trace.

It reads traces and workloads (:mod:`env.traces`) and knows nothing of the gym environment.
"""
