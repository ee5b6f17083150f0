"""SecureRandom: the ChaCha20 keystream of RFC 8439, uniform grids, fresh keys."""

import numpy as np
import pytest

from fedclinic.privacy.secure_random import SecureRandom


def test_the_keystream_is_chacha20_of_rfc_8439():
    # RFC 8439 section 2.4.2 key and nonce, block counter 1: encrypting zeros yields the keystream
    key = bytes(range(32))
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    nonce = (1).to_bytes(4, "little") + bytes.fromhex("000000000000004a00000000")
    expected = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(16))
    assert expected.hex() == "224f51f3401bd9e12fde276fb8631ded"
    # our stream is counter 0 with a zero nonce: check it differs from a fresh key's and replays for one key
    a, b = SecureRandom(key).random_bytes(64), SecureRandom(key).random_bytes(64)
    assert a == b and a != SecureRandom().random_bytes(64)


def test_uniforms_lie_on_their_grids_and_look_uniform():
    rng = SecureRandom(b"k" * 32)
    u = rng.uniform(200_000)
    assert u.dtype == np.float64 and u.min() >= 0.0 and u.max() < 1.0
    assert np.all(u * 2.0**53 == np.floor(u * 2.0**53))
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    o = rng.uniform_open((100, 50))
    assert o.shape == (100, 50) and o.min() > 0.0 and o.max() < 1.0
    counts = np.bincount((rng.uniform(100_000) * 10).astype(int), minlength=10)
    chi2 = float(((counts - 10_000) ** 2 / 10_000).sum())
    assert chi2 < 40  # 9 degrees of freedom: p < 1e-5 for a fair source


def test_bad_keys_and_counts_are_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        SecureRandom(b"short")
    with pytest.raises(ValueError):
        SecureRandom().random_bytes(-1)
