"""How the shipped cost profiles were calibrated: ``python -m env.sim.calibration`` redoes it.

It rewrites the YAML files under ``env/sim/profiles`` and the workload preset
``configs/workload/h200_measured.yaml`` (the H200 fits read the measurements shipped in
``env/sim/data/measured/``, a copy of the project's ``shared/measured/``; without them the
shipped H200 profile is kept and the other two are derived from it). It simulates a few
hundred thousand steps: about a minute on two cores.

One module per profile family, on shared fitting code:

* :mod:`~env.sim.calibration.fitting`: the steady-state approximation of a closed-loop
  benchmark, bench cells simulated exactly as ``specctl-bench`` runs them, and the fit that
  corrects the one by the other (:func:`~env.sim.calibration.fitting.fit_in_simulator`);
* :mod:`~env.sim.calibration.h200`: step latencies measured on SGLang 0.5.15 / H200
  (Llama-3.1-8B shape), fitted point by point; the measured sweep's load generator; the
  profile fitted to traces the plugin recorded on the real server;
* :mod:`~env.sim.calibration.h200_moe`: the Qwen3-30B-A3B MoE fitted to every step of a
  real-token trace of its off server (``env.sim.load_fit``);
* :mod:`~env.sim.calibration.h100`: EAGLE-3 paper, Tables 3 and 4 (SGLang, H100,
  LLaMA-3.1-8B, MT-bench, chain of 3): end-to-end throughputs;
* :mod:`~env.sim.calibration.blackwell`: PUBLISHED.md section 1 (a Kimi-K2.5-class MoE,
  TP=8 on 8x RTX PRO 6000 Blackwell): end-to-end throughputs;
* ``__main__``: the command that runs them all and writes the files.
"""
