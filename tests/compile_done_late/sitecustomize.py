"""Programs compiled beside the steps finish at different times on different hosts, for the
multi-process drills: with this folder on ``PYTHONPATH`` and
``CIERA_TEST_COMPILE_DONE_LATE=P:K`` in the environment, every process compiles what
``--compile-beside`` would compile in a thread at once, in the step that asks for it, and
process P says it is done only when asked for the (K+1)-th time, K steps later than the
others, which say so at once. Steps, not seconds: under load a step takes any time. Python
imports ``sitecustomize`` at start-up, so it reaches the process that trains too, which
``ciera train``'s supervisor starts as a child of its own."""

import os

if os.environ.get("CIERA_TEST_COMPILE_DONE_LATE"):
    import concurrent.futures
    import time

    from ciera_models.train import beside

    class _DoneLate(concurrent.futures.Future):
        """Done from the (``asks``+1)-th time :meth:`done` is asked (once a step, in
        :meth:`~ciera_models.train.beside.CompilesBeside.take_ready`'s agreement)."""

        def __init__(self, result, asks: int):
            super().__init__()
            self.set_result(result)
            self.asks = asks

        def done(self) -> bool:
            self.asks -= 1
            return self.asks < 0

    def _start_done_late(self, key, compile_fn):
        import jax

        late, steps = os.environ["CIERA_TEST_COMPILE_DONE_LATE"].split(":")
        t0 = time.perf_counter()
        result = (compile_fn(), time.perf_counter() - t0)
        self.pending[key] = _DoneLate(result, int(steps) if jax.process_index() == int(late)
                                      else 0)

    beside.CompilesBeside.start = _start_done_late
