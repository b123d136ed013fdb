"""The parts of :class:`~rollsafe.adapters.engines.launcher.EngineLauncher`, one module each.

The launcher (``rollsafe.adapters.engines.launcher``) orchestrates; the public names stay
importable from there and from ``rollsafe.adapters.engines``.

=====================  ==========================================================================
module                 owns
=====================  ==========================================================================
``spec``               :class:`EngineSpec`, its checks, each kind's command line and environment,
                       the spec a restart starts
``process_group``      spawning a group in its own session, the parent-death watchdog, killing
                       and reaping it, ``/proc`` reads; an engine started but not installed
``output``             the output pump (log file, bounded tail, ready line), log files, masking
``fork_server``        the client side of a zygote's fork protocol, handles on forked engines
``standby``            the warm-standby pool: which zygote a start takes, topping it up, counters
``standby_start``      a start forked from a ready zygote, or raced against a fresh spawn
``readiness``          the ready line, the health check, a real engine's HTTP readiness, the
                       start errors
``running``            the engine group running now: install it, stop it, forget it
``real_engine``        what a real SGLang / vLLM start adds: the API-key file, the exposure
                       warning, the files a killed vLLM leaves behind
=====================  ==========================================================================
"""
