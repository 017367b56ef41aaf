"""SGLang plugin entry point (``sglang.srt.plugins: specctl = sglang_hooks.plugin:register``).

SGLang calls :func:`register` in every process it starts, then applies the
registered hooks with ``HookRegistry.apply_hooks()``. In the HTTP server's
process (``load_plugins`` called from the engine or the command-line entries,
:func:`compat.in_http_process`) it only registers the start-up warm-up ``specctl``
in SGLang's custom warm-up registry (:mod:`sglang_hooks.warmup`; it runs only with
``--warmups specctl``), once. Elsewhere ``register`` patches
nothing unless all of these hold, and says why (once, in scheduler processes
only) when it stops:

1. this is a scheduler process (:func:`compat.in_scheduler_process`): the HTTP
   server, detokenizer and DP controller never run the hooks, so they neither
   register them nor import the scheduler for them;
2. the configuration is valid (:mod:`sglang_hooks.config`);
3. the installed SGLang satisfies a tested version's whole contract, checked on
   its source without importing it (:func:`compat.choose_flavour`,
   :mod:`sglang_hooks.contract`); a version other than the tested ones only with
   ``SPECCTL_ALLOW_UNTESTED_SGLANG=1``.

Then it registers, through ``HookRegistry`` only: a class REPLACE of
``AdaptiveSpeculativeParams`` (:mod:`sglang_hooks.policy`) and the four
scheduler hooks of :mod:`sglang_hooks.runtime`. Without any ``SPECCTL_*``
variable the runtime is a *follower*: it strips decision markers (SGLang's
request dispatcher would raise on them and kill the scheduler) and follows a
source rank elsewhere in the TP group, and is SGLang itself when none speaks. The three
hooks of :mod:`sglang_hooks.offswitch` register on every rank: at start-up the TP group
agrees on whether steps=0 runs the plain decode (``SPECCTL_OFF_PATH=decode``, the default
where the variables are set) or SGLang's own path.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sglang_hooks import compat, config, contract

log = logging.getLogger(__name__)

#: The process's runtime once registered (None: the plugin is inactive here).
RUNTIME = None


def register() -> None:
    """Entry point: set up the plugin in this SGLang process, or do nothing."""
    global RUNTIME
    if RUNTIME is not None:
        return
    if not compat.in_scheduler_process():
        if compat.in_http_process():
            from sglang_hooks import warmup

            warmup.register_http()
        return
    try:
        cfg = config.from_env()
        allow_untested = config.allow_untested()
    except config.ConfigError as exc:
        log.warning("specctl: not enabled, bad configuration: %s", exc)
        return
    version = compat.installed_version()
    if version is None:
        return  # SGLang without distribution metadata: not an install we know
    import sglang

    root = Path(sglang.__file__).parent.parent  # not resolved: overlays stay overlays
    flavour = compat.choose_flavour(version, root, allow_untested)
    if flavour.version is None:
        if cfg is not None:  # without SPECCTL_* variables nobody asked for the plugin
            log.warning("specctl: SGLang %s at %s lacks what the hooks need (%s); "
                        "nothing patched", version, root, "; ".join(flavour.problems))
        return
    if flavour.version != version:
        log.warning("specctl: SGLang %s is untested; running as %s, whose contract its "
                    "source satisfies (SPECCTL_ALLOW_UNTESTED_SGLANG=1)", version,
                    flavour.version)
    try:
        _register_hooks(cfg, flavour.version)
    except Exception:  # before the first HookRegistry.register call: nothing patched
        log.exception("specctl: setting up failed; nothing patched")


def _register_hooks(cfg: config.PluginConfig | None, version: str) -> None:
    global RUNTIME
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative import adaptive_spec_params

    from sglang_hooks.policy import make_policy_class
    from sglang_hooks.runtime import Runtime
    from sglang_hooks.switching import quiet_switch_log

    # Everything that can fail happens before the first registration, so that a
    # failure leaves SGLang untouched rather than half patched.
    runtime = Runtime(cfg or config.PluginConfig(off_path=config.follower_off_path(),
                                                off_prefill=config.off_prefill()),
                      version, follower=cfg is None)
    hooks = runtime.hook_table()
    policy_class = make_policy_class(adaptive_spec_params.AdaptiveSpeculativeParams, runtime)
    HookRegistry.register(contract.POLICY_CLASS, policy_class, HookType.REPLACE)
    for target in contract.HOOK_TARGETS:
        hook, hook_type = hooks[target.name]
        HookRegistry.register(target.target, hook, HookType[hook_type])
    for target, (hook, hook_type) in runtime.offswitch.hook_table().items():
        HookRegistry.register(target, hook, HookType[hook_type])
    RUNTIME = runtime
    if cfg is None:
        log.info("specctl: follower hooks registered for SGLang %s (no SPECCTL_* variables "
                 "here: markers stripped, a source rank's decisions followed)", version)
    else:
        quiet_switch_log()  # only TP rank 0 logs it, and that rank has the variables
        log.info("specctl: hooks registered for SGLang %s (controller=%s, rule=%s, record=%s)",
                 version, cfg.controller, cfg.rule, cfg.record_dir)
