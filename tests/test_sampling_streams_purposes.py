"""One home for seeded randomness (issue 31): the stream purposes named in sampling/streams.py,
and one SplitMix64 finaliser, used by the crops and by a batch's seeds."""
from __future__ import annotations

import numpy as np

from fastload.sampling import streams
from fastload.sampling.streams import (BALANCED, DATASET_PASSES, GOLDEN_GAMMA, MIXTURE_BATCHES, MIXTURE_EPOCH,
                                       PERMUTATION, WEIGHTED, WINDOW, generator, seed_sequence, splitmix64)


def test_purposes_are_distinct_and_keep_their_numbers():
    """Renumbering a purpose would change every seeded order: they are pinned."""
    assert (PERMUTATION, WINDOW, WEIGHTED, BALANCED, DATASET_PASSES, MIXTURE_BATCHES, MIXTURE_EPOCH) == tuple(range(7))
    for name in ("PERMUTATION", "WINDOW", "WEIGHTED", "BALANCED", "DATASET_PASSES", "MIXTURE_BATCHES", "MIXTURE_EPOCH"):
        assert name in streams.__doc__, name  # the docstring's table names each one


def test_splitmix64_is_the_reference_finaliser():
    """SplitMix64 with state 0: the first outputs are mix(k * gamma) (Vigna's reference values)."""
    with np.errstate(over="ignore"):
        out = splitmix64(np.arange(1, 4, dtype=np.uint64) * GOLDEN_GAMMA)
    assert [hex(int(v)) for v in out] == ["0xe220a8397b1dcdaf", "0x6e789e6aa1b965f4", "0x6c45d188009454f"]


def test_crops_and_batch_seeds_use_the_one_finaliser():
    import fastload.loader.finish as finish
    import fastload.pipeline.crops as crops

    assert crops.splitmix64 is splitmix64 and finish._mix64 is splitmix64
    # and what they compute is unchanged
    with np.errstate(over="ignore"):
        key = splitmix64(np.array([5], np.uint64) ^ splitmix64(np.array([2], np.uint64) + GOLDEN_GAMMA))
        expect = (splitmix64(np.arange(4, dtype=np.uint64) + key) >> np.uint64(1)).astype(np.int64)
    assert finish.derive_seeds(5, 2, np.arange(4)).tolist() == expect.tolist()
    u = crops.uniforms(7, 3, np.arange(3), 2)
    assert u.shape == (3, 2) and ((0 <= u) & (u < 1)).all()


def test_the_mixture_and_draws_read_their_named_streams():
    from fastload.sampling import permutation
    from fastload.sampling.draws import weighted_draws
    from fastload.sampling.mixture import dataset_draws, mixture_layout

    ids = mixture_layout(np.array([.5, .5]), np.array([10, 10]), batch_size=4, per="epoch", seed=3, epoch=2,
                         epoch_size=20, stop_on=None)
    from fastload.sampling.bijection import bijection, round_keys

    slots = bijection(np.arange(20), 20, round_keys(3, 2, MIXTURE_EPOCH))  # position -> slot; 10 slots each
    assert ids.tolist() == (slots >= 10).astype(int).tolist()
    key = int(seed_sequence(11, 2, DATASET_PASSES).generate_state(1, np.uint64)[0] >> 1)
    assert dataset_draws(50, 11, 2, 0, 50, True).tolist() == permutation(50, key, 0).tolist()
    w = np.ones(10)
    keys = generator(1, 2, WEIGHTED).standard_exponential(10) / w
    assert weighted_draws(w, 10, False, 1, 2).tolist() == np.argsort(keys, kind="stable").tolist()
