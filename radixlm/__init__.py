"""radixlm: an SGLang-style structured generation runtime.

``radixlm.Engine`` runs offline generation in-process; ``radixlm serve`` starts the server.
"""

from radixlm.runtime.engine import Engine

__all__ = ["Engine"]
__version__ = "0.1.0"
