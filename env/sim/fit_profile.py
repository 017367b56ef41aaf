"""``specctl-fit-profile``: fit a cost profile to a recorded trace's decode steps.

Usage (Hydra-style ``key=value`` arguments)::

    specctl-fit-profile trace=runs/trace/ out=my_profile.yaml
    specctl-fit-profile trace='runs/trace-*.parquet' template=h100_llama31_8b \\
        draft_extend=false free=c_fixed,c_request,c_token name=my_server

Keys:

* ``trace`` (required): a trace file, a directory or a glob of rotated files;
* ``out``: where to write the fitted profile (YAML); omitted = only print the report;
* ``template``: shipped profile name or YAML path whose server limits, priors and
  descriptors are kept (default ``h200_llama31_8b``);
* ``draft_extend``: whether steps=0 ran the draft extend (default ``true``;
  ``false`` with ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``). It applies to the
  depth-0 steps of a trace without the warm-up flag, all read as SGLang's steps=0;
  a trace the plugin recorded with its off path since the eighteenth session says of
  each depth-0 step what it ran (``warmup`` column): an off step is fitted as a plain
  decode, the re-entry warm-up as steps=0 with the extend (an older plugin trace's off
  steps are still read as steps=0: fit it with care);
* ``free``: comma-separated coefficients to fit (default
  :data:`env.sim.cost_model.DEFAULT_FREE`);
* ``name``: name of the fitted profile (default: the template's);
* ``per_cell``: fit the median latency of each (batch size, depth) with at least
  5 steps (default ``true``) rather than every step (``false``).

* ``prefill_pairs``: also fit the prefill's attention term ``c_prefill_pair`` with
  ``c_prefill_token`` (:mod:`env.sim.prefill_fit`; default ``false``). A trace the plugin
  recorded with each prefill step's attention pairs (``prefill_pairs`` column, eighth
  session on) serves as it is, radix cache on or off; where its prompts followed cached
  prefixes, ``c_prefill_cached_token`` (per cached token a prompt reads) is fitted too.
  An older trace only where it was
  recorded with ``--disable-radix-cache`` and each prefill step holds prompts of one
  length, from under 512 to at least :data:`LONG_PROMPT_TOKENS` tokens, as
  ``scripts/h200/fidelity_explore.py record`` records them: its pairs are reckoned from
  a step's tokens and requests, which a cached prefix or prompts of mixed lengths in one
  step would make wrong. Such a trace that does not span short to long prompts is
  refused. Without it ``c_prefill_token`` is the per-token cost of
  prefill steps of at least 1,000 tokens and ``c_prefill_pair`` stays the template's.

Prints the per-point errors, the median and the worst, and how many decode steps
were left out as non-physical (more than 100x the median step). Refuses (exit
status 2, naming the coefficients and the data they need) a trace that cannot
determine the free coefficients, e.g. one (batch size, depth) cell for six of them;
any other mistake (a missing or unreadable trace, an unknown key) is one line and
exit status 2 as well (``SPECCTL_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from agents import checks
from agents.cli import UsageError, reported
from env.sim.cost_model import (
    COEFFICIENTS,
    DEFAULT_FREE,
    CostProfile,
    FitReport,
    fit_profile_from_trace,
    load_profile,
    save_profile,
)
from env.sim.load_fit import StepArrays
from env.sim.prefill_fit import PREFILL_TERMS, fit_prefill_terms, whole_prompt_steps
from env.traces.trace_format import Trace, read_trace

#: A trace identifies the prefill attention term when its whole-prompt prefill steps
#: reach this many tokens (and start under 512): the term is a third of a 4,096-token
#: prompt's prefill on the H200 8B and a few percent of a 512-token one.
LONG_PROMPT_TOKENS = 2048

_KEYS = {"trace", "out", "template", "draft_extend", "free", "name", "per_cell",
         "prefill_pairs"}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _parse(argv: Sequence[str]) -> dict[str, str]:
    args: dict[str, str] = {}
    for item in argv:
        key, sep, value = item.lstrip("+").partition("=")
        if not sep:
            raise UsageError(f"expected key=value, got {item!r} (see --help)")
        if key not in _KEYS:
            raise UsageError(f"unknown key {key!r}; known keys: {', '.join(sorted(_KEYS))}")
        args[key] = value
    if "trace" not in args:
        raise UsageError("missing trace=PATH (see --help)")
    return args


def _flag(args: dict[str, str], key: str, default: bool = True) -> bool:
    value = args.get(key, str(default)).lower()
    if value not in _TRUE | _FALSE:
        raise UsageError(f"{key}={value}: expected true or false")
    return value in _TRUE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``specctl-fit-profile``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    with reported("specctl-fit-profile"):
        return _fit(_parse(argv))


def _fit(args: dict[str, str]) -> int:
    draft_extend, per_cell = _flag(args, "draft_extend"), _flag(args, "per_cell")
    free = tuple(f for f in args.get("free", ",".join(DEFAULT_FREE)).split(",") if f)
    unknown = [f for f in free if f not in COEFFICIENTS]
    if unknown or not free:
        raise UsageError(f"free={args.get('free', '')}: unknown coefficient(s) {unknown}; "
                         f"choose from {', '.join(COEFFICIENTS)}")
    name = args.get("template", "h200_llama31_8b")
    template = checks.setting("template", name, lambda: load_profile(name))
    if not any(c in args["trace"] for c in "*?["):  # a glob is the reader's to expand
        checks.existing_file("trace", args["trace"])
    trace = checks.setting("trace", args["trace"], lambda: read_trace(args["trace"]))
    # Nothing to fit (e.g. one cell for six coefficients) is a property of the trace.
    profile, report = checks.setting("trace", args["trace"], lambda: fit_profile_from_trace(
        trace, template, draft_extend=draft_extend, free=free, per_cell=per_cell))
    if _flag(args, "prefill_pairs", default=False):
        profile, prefill_report = checks.setting(
            "trace", args["trace"], lambda: _long_prompt_fit(trace, profile))
        print(prefill_report)
        free = (*free, *PREFILL_TERMS)
    if "name" in args:
        profile = profile.replace(name=args["name"])
    provenance = dict(profile.provenance)
    provenance["calibrated_to"] = "trace: " + ", ".join(str(p) for p in trace.sources)
    provenance["method"] = "specctl-fit-profile (env.sim.cost_model.fit_profile_from_trace)"
    profile = profile.replace(provenance=provenance)
    print(report)
    for key in free:
        print(f"  {key} = {getattr(profile, key) * 1e3:.6g} ms")
    if "out" in args:
        path = save_profile(profile, args["out"])
        print(f"wrote {path}")
    return 0


def _long_prompt_fit(trace: Trace, profile: CostProfile) -> tuple[CostProfile, FitReport]:
    """The prefill terms fitted on the trace's whole prompts (see ``prefill_pairs`` in the
    module docstring); a ValueError says why where they cannot be."""
    steps = StepArrays.from_trace(trace)
    if np.isfinite(steps.prefill_pairs[steps.prefill_tokens > 0]).any():
        return fit_prefill_terms(profile, steps)  # recorded pairs: any prefill step serves
    whole = whole_prompt_steps(steps, profile.server.chunked_prefill_tokens)
    whole &= steps.batch_size > 0
    prompt = steps.prefill_tokens[whole] / steps.batch_size[whole] if whole.any() else [0.0]
    if min(prompt) >= 512 or max(prompt) < LONG_PROMPT_TOKENS:
        raise ValueError(f"prefill_pairs=true needs whole prompts from under 512 to at least "
                         f"{LONG_PROMPT_TOKENS} tokens in prefill steps of their own; this "
                         f"trace's span {min(prompt):.0f}-{max(prompt):.0f}")
    return fit_prefill_terms(profile, steps)


if __name__ == "__main__":
    raise SystemExit(main())
