"""The bounds of one ``fedclinic serve`` server (:mod:`fedclinic.serving.http_server` explains each).

Apart from the server so that the command line (:mod:`fedclinic.serving.serve_command`) can show their defaults
without importing the HTTP stack (uvicorn, Starlette: the ``export`` extra), which a base install lacks.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedclinic.errors import ConfigError
from fedclinic.serving.pixel_budget import DEFAULT_MAX_PIXELS


@dataclass(frozen=True)
class ServeLimits:
    """The bounds of one server (module doc); ``None``: the bundle family's default."""

    max_body: int | None = None
    max_inflight_bytes: int | None = None
    max_connections: int = 1000
    backlog: int = 2048
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    inference_workers: int = 2
    inference_queue: int = 16
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    grpc_max_concurrent_rpcs: int = 64

    def check(self) -> None:
        """ConfigError naming the flag of a value out of range."""
        for flag, value, low in (("--max-connections", self.max_connections, 1), ("--backlog", self.backlog, 1),
                                 ("--inference-workers", self.inference_workers, 1),
                                 ("--inference-queue", self.inference_queue, 0),
                                 ("--max-image-pixels", self.max_image_pixels, 1),
                                 ("--grpc-max-concurrent-rpcs", self.grpc_max_concurrent_rpcs, 1),
                                 ("--max-body", self.max_body if self.max_body is not None else 1, 1)):
            if value < low:
                raise ConfigError(f"{flag} must be >= {low}, got {value}")
        for flag, seconds in (("--header-timeout", self.header_timeout), ("--body-timeout", self.body_timeout),
                              ("--keep-alive-timeout", self.keep_alive_timeout)):
            if not seconds > 0:
                raise ConfigError(f"{flag} must be > 0 seconds, got {seconds}")
