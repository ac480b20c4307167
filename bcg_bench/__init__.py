"""bcg's benchmark: ``bcg bench micro|vllm|sglang|report`` (:mod:`bcg_bench.cli`).

A package of its own on top of the runtime: it imports :mod:`bcg_plugin`, never the reverse, and
needs the ``bench`` extra (matplotlib for the plots, psutil for the host-speed probe).

``bcg bench vllm|sglang`` (:mod:`bcg_bench.harness`) runs every mode in a process of its own
(:mod:`bcg_bench.vllm_mode`, :mod:`bcg_bench.sglang_mode`). Each mode process installs its engine's
timers itself, in the processes that run the model, and no plugin entry point is involved: the
plugin's ``register()`` installs exactly what serving needs, benchmark or not.

* vLLM: the mode process runs the engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
  it wraps vLLM's runner symbols directly (``vllm_mode.Timers``), after bcg's own patches so the
  timers wrap them too. At tp or dp above 1 the model runs in vLLM's worker processes, out of the
  timers' reach, and the mode records end-to-end figures only.
* SGLang: the schedulers are processes SGLang spawns. The mode process starts its engine through
  :func:`bcg_bench.sglang_timers.start_engine`, an ``sglang.Engine`` whose
  ``run_scheduler_process_func`` (SGLang's own extension point for engines with custom processes)
  installs the timers in each scheduler before SGLang loads its plugins there. That works whatever
  the parent's main module is, so the GPU tests' engines (started under pytest or as scripts) get
  the same records; re-importing the parent's main module in the spawned child (multiprocessing's
  ``__mp_main__``) would reach only engines started from ``python -m bcg_bench.sglang_mode``.
"""
