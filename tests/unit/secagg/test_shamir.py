"""Shamir secret sharing over F_p (fedclinic.secagg.shamir): correctness, secrecy, integrity."""

import itertools
from collections import Counter
from unittest import mock

import pytest
from hypothesis import given, settings, strategies as st

from fedclinic.secagg import shamir
from fedclinic.secagg.errors import SecAggIntegrityError

SECRETS = st.binary(min_size=32, max_size=32)


def _miller_rabin(n: int, bases) -> bool:
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


_BASES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71] + [
    (0x9E3779B97F4A7C15 * i) % (1 << 200) + 2 for i in range(1, 41)]


def test_prime_is_the_smallest_prime_above_2_256():
    assert shamir.PRIME == 2 ** 256 + 297
    assert _miller_rabin(shamir.PRIME, _BASES)  # error probability < 4^-60 for a composite
    assert not any(_miller_rabin(2 ** 256 + i, _BASES[:8]) for i in range(1, 297))
    assert shamir.PRIME > 2 ** (8 * shamir.SECRET_BYTES)  # every 32-byte secret is one field element


@settings(max_examples=60, deadline=None)
@given(secret=SECRETS, n=st.integers(1, 12), data=st.data())
def test_any_t_of_n_shares_reconstruct(secret, n, data):
    t = data.draw(st.integers(1, n))
    xs = data.draw(st.lists(st.integers(1, 10_000), min_size=n, max_size=n, unique=True))
    shares = shamir.split(shamir.secret_to_int(secret), xs, t)
    subset = data.draw(st.lists(st.sampled_from(xs), min_size=t, max_size=n, unique=True))
    got = shamir.reconstruct({x: shares[x] for x in subset}, t)
    assert shamir.int_to_secret(got) == secret


@settings(max_examples=60, deadline=None)
@given(secret=SECRETS, n=st.integers(2, 12), data=st.data())
def test_t_minus_1_shares_give_a_wrong_value(secret, n, data):
    """Interpolating t-1 shares as if they were enough yields f'(0) != s except with probability 1/p."""
    t = data.draw(st.integers(2, n))
    xs = list(range(1, n + 1))
    shares = shamir.split(shamir.secret_to_int(secret), xs, t)
    subset = data.draw(st.lists(st.sampled_from(xs), min_size=t - 1, max_size=t - 1, unique=True))
    pts = {x: shares[x] for x in subset}
    assert shamir.interpolate(pts, 0) != shamir.secret_to_int(secret)
    with pytest.raises(ValueError, match="cannot reconstruct"):
        shamir.reconstruct(pts, t)


@settings(max_examples=40, deadline=None)
@given(secret=SECRETS, candidate=st.integers(0, shamir.PRIME - 1), n=st.integers(2, 8), data=st.data())
def test_t_minus_1_shares_are_consistent_with_every_candidate_secret(secret, candidate, n, data):
    """For any t-1 shares and any candidate secret s' there is a degree <= t-1 polynomial through
    (0, s') and the shares, so t-1 shares cannot rule out any secret."""
    t = data.draw(st.integers(2, n))
    xs = list(range(1, n + 1))
    shares = shamir.split(shamir.secret_to_int(secret), xs, t)
    subset = data.draw(st.lists(st.sampled_from(xs), min_size=t - 1, max_size=t - 1, unique=True))
    pts = {0: candidate, **{x: shares[x] for x in subset}}  # t points -> a degree <= t-1 polynomial g
    assert shamir.interpolate(pts, 0) == candidate
    # g is a valid sharing of the candidate: its shares at the observed points are what was observed
    for x in subset:
        assert shamir.interpolate(pts, x) == shares[x]


@pytest.mark.parametrize("prime,t,xs", [(5, 2, (1, 3)), (7, 3, (1, 2, 5)), (11, 2, (4, 9, 10)),
                                        (13, 3, (2, 3, 7, 12))])
def test_t_minus_1_shares_are_exactly_uniform_whatever_the_secret(prime, t, xs):
    """Exhaustive, in a tiny field: drive split() through every coefficient vector. For each secret
    the map coefficients -> (first t-1 shares) is a bijection onto F_p^(t-1), so the shares a coalition
    of t-1 sees have the same (uniform) distribution for every secret: zero information."""
    seen = t - 1
    for secret in range(prime):
        observed = Counter()
        for coeffs in itertools.product(range(prime), repeat=t - 1):
            it = iter(coeffs)
            with mock.patch.object(shamir._secrets, "randbelow", side_effect=lambda _p: next(it)):
                shares = shamir.split(secret, xs, t, prime=prime)
            observed[tuple(shares[x] for x in xs[:seen])] += 1
        assert len(observed) == prime ** seen and set(observed.values()) == {1}
        assert shamir.reconstruct(shares, t, prime=prime) == secret


def test_corrupted_extra_share_is_detected():
    shares = shamir.split(12345, [1, 2, 3, 4, 5], 3)
    shares[4] = (shares[4] + 1) % shamir.PRIME
    with pytest.raises(SecAggIntegrityError, match="x=4"):
        shamir.reconstruct(shares, 3)


def test_encoding_round_trip_and_rejections():
    v = shamir.PRIME - 1
    assert shamir.decode_share(shamir.encode_share(v)) == v
    with pytest.raises(SecAggIntegrityError, match="not a field element"):
        shamir.decode_share(shamir.PRIME.to_bytes(33, "big"))
    with pytest.raises(SecAggIntegrityError, match="33 bytes"):
        shamir.decode_share(b"\x00" * 32)
    with pytest.raises(SecAggIntegrityError, match="not a 32-byte secret"):
        shamir.int_to_secret(2 ** 256)
    with pytest.raises(ValueError, match="32 bytes"):
        shamir.secret_to_int(b"short")


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError, match="distinct"):
        shamir.split(1, [1, 1, 2], 2)
    with pytest.raises(ValueError, match="abscissa 0"):
        shamir.split(1, [0, 1, 2], 2)
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(1, [1, 2], 3)
    with pytest.raises(ValueError, match="field"):
        shamir.split(shamir.PRIME, [1, 2], 2)
