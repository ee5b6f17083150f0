"""The release and the wire protocol version: one place, importable by every layer without loading anything else.

``fedclinic.__version__`` and ``fedclinic.PROTOCOL_VERSION`` re-export these.
"""

__version__ = "0.1.0"
#: the version of the gRPC protocol between the SDK, the aggregator and the agents
PROTOCOL_VERSION = 1
