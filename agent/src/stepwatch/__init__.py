"""stepwatch: a one-line training-run health agent.

    watch = stepwatch.attach(model, optimizer, run="my-run")

Importing this package needs only the standard library; torch is imported inside `attach()`.
"""

from ._version import __version__
from ._watch import NullWatch, Watch, attach

__all__ = ["NullWatch", "Watch", "__version__", "attach"]
