"""What "speculation off" costs: SGLang's steps=0 against a server without speculation.

On a real H200 (SGLang 0.5.15.post1) a steps=0 step of a speculative server was
far slower than a step of the same model served without speculation: mean TPOT
+32 / +52 / +116 / +186% at C = 1 / 8 / 32 / 48 on a Llama-3.1-8B shape; skipping the draft extend
(``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``) changed nothing measurable.
So the cost is the speculative path itself (verify-mode target forward and
bookkeeping), modelled by the profile's ``c_steps0 + c_steps0_request * batch``
(see :mod:`env.sim.cost_model`).

This module fits those two coefficients to such measurements: for each load,
the ratio ``r`` of the no-speculation server's TPOT to the steps=0 server's,
measured at the same concurrency. With ``L`` the profile's steps=0 step latency
there (fitted to the speculative server, draft extend included) and ``E`` its
draft-extend part, a server without speculation takes ``r * L``, so::

    c_steps0 + c_steps0_request * batch = (1 - r) * L - E

is fitted by non-negative least squares on relative errors, and the same
amounts are taken out of ``c_fixed`` / ``c_request``: every speculative and
steps=0 latency of the profile stays what it was calibrated to.

    python -m env.sim.off_cost        # rewrite the H200 profiles' off-path terms
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from env.sim.cost_model import CostProfile, load_profile, nnls, save_profile

#: The checkout this module sits in (env/sim/off_cost.py).
_REPO = Path(__file__).resolve().parents[2]


def _measured_dir(name: str) -> Path:
    """``shared/measured/<name>`` in the nearest folder above this checkout that has it."""
    for parent in Path(__file__).resolve().parents[1:]:
        candidate = parent / "shared" / "measured" / name
        if candidate.is_dir():
            return candidate
    return _REPO.parent / "shared" / "measured" / name


#: The measurements (beside the repository checkout, as the other calibration data).
OFFSWITCH_DIR = _measured_dir("h200-sglang-0.5.15-offswitch")
#: The steps=0 one-batch sweep of the dense 8B server (the project's own H200 session).
DENSE_STEPS0_SWEEP = _REPO / "docs" / "results" / "h200" / "sweep_real.json"
#: KV tokens per request in the measured runs: 256-token prompts, about half of the
#: 128 new tokens generated (dense one-batch runs).
DENSE_KV_PER_REQUEST = 256 + 64


@dataclass(frozen=True)
class OffPoints:
    """Measured loads: decode batch, KV tokens, and TPOT(no speculation) / TPOT(steps=0)."""

    batch_size: np.ndarray
    kv_tokens: np.ndarray
    ratio: np.ndarray
    source: str

    def __post_init__(self) -> None:
        if not (len(self.batch_size) == len(self.kv_tokens) == len(self.ratio) > 0):
            raise ValueError(f"{self.source}: need equally many batch, kv and ratio entries")
        if not np.all((self.ratio > 0) & (self.ratio <= 1.5)):
            raise ValueError(f"{self.source}: TPOT ratios must lie in (0, 1.5], got {self.ratio}")


def _tpot(path: Path, *keys: str) -> float:
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in keys:
        if key not in data:
            raise ValueError(f"{path}: missing key {'.'.join(keys)!r}")
        data = data[key]
    if "mean_tpot_ms" not in data:
        raise ValueError(f"{path}: {'.'.join(keys)}: missing field 'mean_tpot_ms'")
    return float(data["mean_tpot_ms"])


def dense_h200_points(offswitch: Path = OFFSWITCH_DIR,
                      steps0_sweep: Path = DENSE_STEPS0_SWEEP) -> OffPoints:
    """Llama-3.1-8B shape, one batch of C requests: C = 1, 8, 32, 48."""
    nospec = offswitch / "results" / "dense8b_nospec_server.json"
    cs = (1, 8, 32, 48)
    ratio = [_tpot(nospec, str(c)) / _tpot(steps0_sweep, "static_0", str(c)) for c in cs]
    batch = np.array(cs, dtype=float)
    return OffPoints(batch, batch * DENSE_KV_PER_REQUEST, np.array(ratio),
                     f"{nospec.name} / {steps0_sweep.name} static_0")


def fit_off_path(profile: CostProfile, points: OffPoints) -> tuple[CostProfile, dict]:
    """The profile with ``c_steps0`` / ``c_steps0_request`` fitted to ``points``.

    Returns the profile and a report (per point: the off latency the ratio
    implies and the fitted one, in ms).
    """
    b, kv = points.batch_size, points.kv_tokens
    steps0 = profile.step_latency_array(b, 0, kv, 0, True, True)
    extend = steps0 - profile.step_latency_array(b, 0, kv, 0, False, True)
    target_off = points.ratio * steps0
    # The verify-mode KV cost is on the speculative path too but not fitted here: what
    # c_steps0 + c_steps0_request * batch must hold is the rest of the difference.
    overhead = steps0 - extend - target_off - profile.c_steps0_kv * kv
    # Relative to the off latency: that is what the fit must get right.
    scale = 1.0 / target_off
    design = np.stack([np.ones_like(b), b], axis=1) * scale[:, None]
    c0, c1 = nnls(design, overhead * scale)
    # What is moved must exist in the per-step / per-request terms it comes out of.
    c0, c1 = min(c0, profile.c_fixed + profile.c_steps0), \
        min(c1, profile.c_request + profile.c_steps0_request)
    fitted = profile.replace(
        c_fixed=profile.c_fixed + profile.c_steps0 - c0,
        c_request=profile.c_request + profile.c_steps0_request - c1,
        c_steps0=float(c0), c_steps0_request=float(c1))
    off = fitted.step_latency_array(b, 0, kv, 0, False, False)
    report = {
        "source": points.source,
        "c_steps0_ms": round(c0 * 1e3, 4),
        "c_steps0_request_ms": round(c1 * 1e3, 5),
        "points": [
            {"batch_size": int(bi), "tpot_ratio_measured": round(float(r), 4),
             "steps0_ms": round(float(s) * 1e3, 3), "off_ms_implied": round(float(t) * 1e3, 3),
             "off_ms_model": round(float(o) * 1e3, 3),
             "rel_error": round(float(o / t - 1.0), 4)}
            for bi, r, s, t, o in zip(b, points.ratio, steps0, target_off, off, strict=True)
        ],
    }
    provenance = dict(fitted.provenance)
    provenance["off_path"] = {
        "method": "env.sim.off_cost.fit_off_path: c_steps0 + c_steps0_request * batch = "
                  "(1 - TPOT ratio) * steps0 latency - draft extend, NNLS on relative errors; "
                  "the same amounts taken out of c_fixed / c_request",
        **report,
    }
    return fitted.replace(provenance=provenance), report


def main() -> None:
    """Rewrite the off-path terms of the H200 profiles from the measurements."""
    folder = Path(__file__).parent / "profiles"
    # Not the MoE's: h200_qwen3_30b_a3b is fitted to a real-token trace of its off server,
    # which holds plain and speculative steps (env.sim.calibration.h200_moe); its one
    # steps=0 measurement (run_phases.py's closed loops) decoded token 100 where the
    # no-speculation server decoded real tokens, two routing regimes.
    for name, points in (("h200_llama31_8b", dense_h200_points()),
                         ("h200_llama31_8b_recorded", dense_h200_points())):
        profile, report = fit_off_path(load_profile(folder / f"{name}.yaml"), points)
        save_profile(profile, folder / f"{name}.yaml")
        print(name, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
