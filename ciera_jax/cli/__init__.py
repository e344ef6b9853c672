"""The ``ciera`` command: ``main.py`` builds it from the ``ciera.commands`` entry points.

Each subcommand is one module with ``add_arguments(parser)`` and ``run(args)``: calibrate.py,
demo.py (with drift_demo.py, the gathers it runs), plan.py, simulate.py; ``ciera train`` is
registered by ``ciera_models``. May import any layer of the library.
"""
