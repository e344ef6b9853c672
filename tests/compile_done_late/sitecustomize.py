"""Programs compiled beside the steps finish at different times on different hosts, for the
multi-process drills: with this folder on ``PYTHONPATH`` and
``CIERA_TEST_COMPILE_DONE_LATE=P:S`` in the environment, every process compiles what
``--compile-beside`` would compile in a thread at once, in the step that asks for it, and
process P says it is done S seconds later, the others at once. Python imports
``sitecustomize`` at start-up, so it reaches the process that trains too, which ``ciera
train``'s supervisor starts as a child of its own."""

import os

if os.environ.get("CIERA_TEST_COMPILE_DONE_LATE"):
    import concurrent.futures
    import threading
    import time

    from ciera_models import beside

    def _start_done_late(self, key, compile_fn):
        import jax

        late, seconds = os.environ["CIERA_TEST_COMPILE_DONE_LATE"].split(":")
        t0 = time.perf_counter()
        result = (compile_fn(), time.perf_counter() - t0)
        future = concurrent.futures.Future()
        if jax.process_index() == int(late):
            threading.Timer(float(seconds), future.set_result, args=(result,)).start()
        else:
            future.set_result(result)
        self.pending[key] = future

    beside.CompilesBeside.start = _start_done_late
