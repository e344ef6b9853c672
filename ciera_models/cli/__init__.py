"""The ``ciera`` subcommands this package registers (``ciera.commands`` entry points).

train.py  ``ciera train``
aot.py    ``ciera aot``

The top layer of ``ciera_models``; light to import (the parser loads no JAX).
"""
