"""Everything that crosses the wire: model packages, tensor chunks and their codecs' header fields, the
compressed downlink and the gRPC channel plumbing.
"""
