"""SGLang plugin entry point (``sglang.srt.plugins: specctl = sglang_hooks.plugin:register``).

SGLang calls :func:`register` in every process it starts, then applies the
registered hooks with ``HookRegistry.apply_hooks()``. ``register`` patches
nothing unless all of these hold, and says why (once) when it stops:

1. a ``SPECCTL_*`` variable enables the plugin (:mod:`sglang_hooks.config`)
   and the configuration is valid;
2. the installed SGLang is a supported version (:data:`compat.SUPPORTED_VERSIONS`);
3. every hook target exists with the expected parameters, checked on the
   installed source without importing it (:mod:`sglang_hooks.contract`).

Then it registers, through ``HookRegistry`` only: a class REPLACE of
``AdaptiveSpeculativeParams`` (:mod:`sglang_hooks.policy`) and the four
scheduler hooks of :mod:`sglang_hooks.runtime`, and (unless ``SPECCTL_OFF_PATH=sglang``)
the three hooks of :mod:`sglang_hooks.offswitch` that make steps=0 a plain decode.
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
    try:
        cfg = config.from_env()
    except config.ConfigError as exc:
        log.warning("specctl: not enabled, bad configuration: %s", exc)
        return
    if cfg is None:
        return
    version = compat.installed_version()
    if version not in compat.SUPPORTED_VERSIONS:
        log.warning("specctl: SGLang %s is not supported (supported: %s); nothing patched",
                    version, ", ".join(compat.SUPPORTED_VERSIONS))
        return
    import sglang

    root = Path(sglang.__file__).parent.parent  # not resolved: overlays stay overlays
    problems = contract.target_problems(root)
    if problems:
        log.warning("specctl: SGLang %s at %s lacks what the hooks need (%s); nothing patched",
                    version, root, "; ".join(problems))
        return
    try:
        _register_hooks(cfg, version)
    except Exception:  # before the first HookRegistry.register call: nothing patched
        log.exception("specctl: setting up failed; nothing patched")


def _register_hooks(cfg: config.PluginConfig, version: str) -> None:
    global RUNTIME
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative import adaptive_spec_params

    from sglang_hooks.policy import make_policy_class
    from sglang_hooks.runtime import Runtime

    # Everything that can fail happens before the first registration, so that a
    # failure leaves SGLang untouched rather than half patched.
    runtime = Runtime(cfg, version)
    hooks = runtime.hook_table()
    policy_class = make_policy_class(adaptive_spec_params.AdaptiveSpeculativeParams, runtime)
    HookRegistry.register(contract.POLICY_CLASS, policy_class, HookType.REPLACE)
    for target in contract.HOOK_TARGETS:
        hook, hook_type = hooks[target.name]
        HookRegistry.register(target.target, hook, HookType[hook_type])
    if runtime.offswitch is not None:
        for target, (hook, hook_type) in runtime.offswitch.hook_table().items():
            HookRegistry.register(target, hook, HookType[hook_type])
    RUNTIME = runtime
    log.info("specctl: hooks registered for SGLang %s (controller=%s, rule=%s, record=%s)",
             version, cfg.controller, cfg.rule, cfg.record_dir)
