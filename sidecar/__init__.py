"""voxrecall's sidecar: a grpc.aio service that answers each caller turn within its budget."""

__version__ = "0.1.0"
