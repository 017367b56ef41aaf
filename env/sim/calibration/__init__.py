"""How the shipped cost profiles were calibrated (``python -m env.sim.calibration``)."""
