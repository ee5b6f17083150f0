"""Gaussian noise for differential privacy from a cryptographically secure stream.

:class:`SecureGaussian` turns the ChaCha20 keystream of :class:`~fedclinic.strategies.secure_random.SecureRandom`
into samples of ``N(0, std^2)``. Every DP noise draw of fedclinic uses it: the sites' DP-SGD noise
(:mod:`fedclinic.privacy.dp_sgd`, through :class:`fedclinic.privacy.tensor_noise.TensorNoise`) and the
aggregator's client-level DP noise (:mod:`fedclinic.strategies.client_dp`). It is numpy only (the aggregator has
no torch).

Method: Marsaglia's polar method (Marsaglia & Bray, SIAM Review 6(3), 1964), in float64::

    u, v = uniform on (-1, 1)                    52 random bits each: the odd multiples of 2^-52
    s    = u^2 + v^2                             rejected unless s < 1 (accepted with probability pi/4)
    z1, z2 = u * sqrt(-2 ln s / s), v * sqrt(-2 ln s / s)      two independent N(0, 1) samples

It is exact for exact uniforms on the disc and needs no sine or cosine (the Box-Muller transform's cost); the
samples are scaled by ``std`` in float64 and rounded once to the target dtype. Every word of the keystream is
used once, so the samples are as unpredictable as the keystream: without the key, no one can replay or predict
them (a Mersenne Twister's state, by contrast, is recovered from 624 consecutive outputs, after which every
later draw can be subtracted from what was released).

Floating-point attacks (Mironov, CCS 2012; Jin et al., IEEE S&P 2022, arXiv:2112.05307): a sampler computed in
the precision of its output reaches only a sparse subset of the floating-point numbers, so an observer of
``x + noise`` can test which ``x`` could have produced it. Opacus' ``secure_mode`` answers with the sum of four
float32 draws halved (Holohan & Braghin, arXiv:2107.10138, Sec. 5.1). Here the sample is computed in float64 from
52-bit uniforms and rounded *once* to float32 (the DP-SGD gradients and the aggregator's accumulators): each
float32 value in the bulk of the distribution covers about 2^29 float64 values, of which the polar method
reaches a dense set, so every float32 value is reachable with probability within float64 rounding error
(relative ~1e-15) of the exactly rounded Gaussian, except where the ideal probability is itself below ~1e-15 per
coordinate (beyond about 8 standard deviations, where the 52-bit grid of ``s`` thins out, and magnitudes below
about 1e-16 std). Scaling by ``std`` happens before the rounding (scaling a rounded float32 would leave gaps).
For a float64 target (no coarser grid to round to) the sample is the sum of four float64 draws halved, Opacus'
answer. What remains: the addition of the noise to the clipped gradient (or update) in float32, and every
later floating-point operation (division by the batch size, the optimizer step, the model's own arithmetic),
round in a way that depends on both operands; no known attack exploits that through an optimizer, but it is
not proven harmless (Opacus' secure mode leaves the same).

Replay: a test passes ``SecureGaussian(SecureRandom(key))`` or :meth:`SecureGaussian.replay` to repeat a stream
bit for bit; every site and aggregator path uses a fresh ``SecureGaussian()`` (keyed from ``os.urandom``).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import numpy.typing as npt

from fedclinic.strategies.secure_random import SecureRandom

#: float64 values per chunk: keeps the temporaries (a few arrays of this size) in the CPU's L2 cache
CHUNK = 1 << 17
_EXPONENT_ONE = np.uint64(0x3FF0000000000000)  # the bits of 1.0: OR'd with 52 random mantissa bits gives [1, 2)
_HALF_STEP = 2.0 ** -52


def replay_key(entropy: int, purpose: str) -> bytes:
    """A 32-byte :class:`SecureRandom` key from a test's integer ``entropy`` and the stream's ``purpose`` (so the
    streams of one replayed round -- e.g. DP-SGD's sampler and noise -- differ). For tests and replays only."""
    return hashlib.sha256(b"fedclinic replay\x00" + purpose.encode() + b"\x00"
                          + int(entropy).to_bytes(32, "little", signed=True)).digest()


class SecureGaussian:
    """``N(0, std^2)`` samples from a :class:`SecureRandom` keystream (polar method in float64, see the module
    docstring)."""

    def __init__(self, source: SecureRandom | None = None) -> None:
        self._source = source if source is not None else SecureRandom()

    @classmethod
    def replay(cls, entropy: int, purpose: str) -> "SecureGaussian":
        """A sampler whose stream is fixed by ``(entropy, purpose)``: for tests that replay a round."""
        return cls(SecureRandom(replay_key(entropy, purpose)))

    def sample(self, shape: int | tuple[int, ...], std: float, dtype: npt.DTypeLike = np.float32) -> np.ndarray:
        """An array of ``shape`` with independent ``N(0, std^2)`` entries in ``dtype`` (float16/32/64), each
        computed in float64 and rounded once; a float64 entry is the sum of four draws halved (see the module
        docstring). ``std`` must be finite and >= 0 (0 gives zeros and draws nothing)."""
        dt = np.dtype(dtype)
        if dt.kind != "f":
            raise ValueError(f"Gaussian noise needs a floating-point dtype, got {dt}")
        std = float(std)
        if not (std >= 0 and math.isfinite(std)):
            raise ValueError(f"noise standard deviation must be finite and >= 0, got {std}")
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        n = math.prod(shape)
        out = np.zeros(n, dt)
        if std == 0 or n == 0:
            return out.reshape(shape)
        draws = 1 if np.finfo(dt).nmant <= 23 else 4
        scale = std / math.sqrt(draws)
        for start in range(0, n, CHUNK):
            m = min(CHUNK, n - start)
            z = self._standard(m)
            for _ in range(draws - 1):
                z += self._standard(m)
            z *= scale
            out[start:start + m] = z  # the one rounding to dtype
        return out.reshape(shape)

    def _standard(self, m: int) -> np.ndarray:
        """``m`` independent N(0, 1) samples in float64 (Marsaglia's polar method)."""
        out = np.empty(m, np.float64)
        filled = 0
        while filled < m:
            pairs = math.ceil((m - filled) / 2 / (math.pi / 4) * 1.02) + 16  # rarely a second pass
            words = self._source.integers(2 * pairs) >> np.uint64(12)  # 52 random bits (and a writable copy)
            words |= _EXPONENT_ONE
            uv = words.view(np.float64)          # 1 + j 2^-52 in [1, 2)
            uv -= 1.5                             # exact
            uv *= 2.0                             # exact: [-1, 1) on the grid 2^-51
            uv += _HALF_STEP                      # exact: odd multiples of 2^-52 in (-1, 1), symmetric
            u, v = uv[:pairs], uv[pairs:]
            s = u * u
            s += v * v
            keep = s < 1.0                        # s > 0 always (u, v are never 0)
            u, v, s = u[keep], v[keep], s[keep]
            factor = np.log(s)
            factor *= -2.0
            factor /= s
            np.sqrt(factor, out=factor)
            take = min(len(s), (m - filled + 1) // 2)
            u = u[:take] * factor[:take]
            v = v[:take] * factor[:take]
            first = min(take, m - filled)
            out[filled:filled + first] = u[:first]
            filled += first
            second = min(take, m - filled)
            out[filled:filled + second] = v[:second]
            filled += second
        return out
