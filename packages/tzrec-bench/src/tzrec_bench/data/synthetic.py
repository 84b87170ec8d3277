"""A synthetic data set shaped like real interaction logs, deterministic by seed.

- Item popularity follows a power law: the item of popularity rank ``r`` (1 = most popular)
  has weight ``r ** -popularity_exponent``; ranks are shuffled over the ids.
- Sequence lengths are log-normal (heavy-tailed like MovieLens users' activity), clipped to
  ``[MIN_LENGTH, max_length]``.
- Items belong to topics; each user prefers a few (Dirichlet draw) and tends to stay on a
  topic from one event to the next, so the next item is predictable from the history and a
  sequential model can beat popularity.
- Timestamps start uniformly over half a year from 2020-01-01 and advance by log-normal gaps
  (minutes typically, days sometimes); rounding to seconds leaves some ties.
- Ratings are 1 to 5 (an item quality plus noise); the action mask has CLICK on every event,
  LONG_VIEW for ratings of 4 and 5, LIKE for 5 and HATE for 1.
"""

from __future__ import annotations

import numpy as np

from tzrec_bench.data.actions import Action
from tzrec_bench.data.dataset import SequenceDataset

# every user has enough events for leave-one-out's two targets and a history of several
MIN_LENGTH = 5
LENGTH_SIGMA = 1.0
TOPIC_CONCENTRATION = 0.2  # Dirichlet alpha: small, so each user favours few topics
TOPIC_STICKINESS = 0.8  # chance that an event stays on the previous event's topic
START = 1_577_836_800  # 2020-01-01T00:00:00Z
START_SPREAD_S = 183 * 86_400
MEDIAN_GAP_S = 600.0
GAP_SIGMA = 2.0


def _lengths(
    rng: np.random.Generator, num_users: int, median: int, max_length: int
) -> np.ndarray:
    raw = rng.lognormal(np.log(median), LENGTH_SIGMA, size=num_users)
    return np.clip(np.rint(raw), MIN_LENGTH, max_length).astype(np.int64)


def _topics(rng: np.random.Generator, user: np.ndarray, first: np.ndarray, num_topics: int,
            num_users: int) -> np.ndarray:
    """[N] each event's topic: a fresh draw from the user's preference, else the last one's."""
    preference = rng.dirichlet(np.full(num_topics, TOPIC_CONCENTRATION), size=num_users)
    cdf = np.cumsum(preference, axis=1)
    cdf[:, -1] = 1.0  # rounding must not leave a gap above the last topic
    # one searchsorted for all users: row u's CDF shifted into [u, u + 1)
    shifted = (cdf + np.arange(num_users)[:, None]).ravel()
    drawn = np.searchsorted(shifted, user + rng.random(len(user)), side="right")
    drawn = np.minimum(drawn - user * num_topics, num_topics - 1)
    fresh = first | (rng.random(len(user)) >= TOPIC_STICKINESS)
    # carry each fresh draw forward to the next one; every user's first event is fresh
    last_fresh = np.maximum.accumulate(np.where(fresh, np.arange(len(user)), 0))
    return drawn[last_fresh]


def _items(rng: np.random.Generator, topic: np.ndarray, num_items: int, num_topics: int,
           exponent: float) -> np.ndarray:
    """[N] items drawn by popularity within each event's topic."""
    weight = np.arange(1, num_items + 1, dtype=np.float64) ** -exponent
    weight = weight[rng.permutation(num_items)]  # popularity rank is unrelated to the id
    item_topic = rng.permutation(np.arange(num_items) % num_topics)  # no topic is empty
    by_topic = np.argsort(item_topic, kind="stable")
    topic_of = item_topic[by_topic]
    mass = np.cumsum(weight[by_topic])
    topic_start = np.searchsorted(topic_of, np.arange(num_topics))
    topic_end = np.append(topic_start[1:], num_items)
    before = np.where(topic_start > 0, mass[topic_start - 1], 0.0)
    total = mass[topic_end - 1] - before
    # topic t's CDF shifted into (t, t + 1], so one searchsorted serves every topic
    cdf = topic_of + (mass - before[topic_of]) / total[topic_of]
    cdf[topic_end - 1] = np.arange(1, num_topics + 1)
    pos = np.searchsorted(cdf, topic + rng.random(len(topic)), side="right")
    return by_topic[np.minimum(pos, num_items - 1)]


def synthetic(
    num_users: int = 2000,
    num_items: int = 4000,
    *,
    seed: int = 0,
    popularity_exponent: float = 1.0,
    median_length: int = 40,
    max_length: int = 1000,
    num_topics: int = 16,
) -> SequenceDataset:
    """A synthetic dataset named ``"synthetic"``; the same arguments give the same data.

    Args:
        num_users (int): U. Default: 2000.
        num_items (int): the catalogue size; items never drawn are absent from the dense ids,
            so ``num_items`` of the result may be a little smaller. Default: 4000.
        seed (int): the random seed. Default: 0.
        popularity_exponent (float): the power law's exponent (1.0 is Zipf's law).
            Default: 1.0.
        median_length (int): the median events per user. Default: 40.
        max_length (int): the most events per user. Default: 1000.
        num_topics (int): item topics (at most ``num_items`` are used). Default: 16.
    """
    for field, value, least in (
        ("num_users", num_users, 1), ("num_items", num_items, 1), ("num_topics", num_topics, 1),
        ("median_length", median_length, 1), ("max_length", max_length, MIN_LENGTH),
    ):
        if value < least:
            raise ValueError(f"{field} must be at least {least}; got {value}")
    if popularity_exponent < 0:
        raise ValueError(f"popularity_exponent must be >= 0; got {popularity_exponent}")
    num_topics = min(num_topics, num_items)
    rng = np.random.default_rng(seed)
    lengths = _lengths(rng, num_users, median_length, max_length)
    user = np.repeat(np.arange(num_users, dtype=np.int64), lengths)
    first = np.zeros(len(user), dtype=bool)
    first[np.cumsum(lengths) - lengths] = True
    topic = _topics(rng, user, first, num_topics, num_users)
    items = _items(rng, topic, num_items, num_topics, popularity_exponent)

    gaps = np.floor(rng.lognormal(np.log(MEDIAN_GAP_S), GAP_SIGMA, size=len(user)))
    gaps[first] = 0
    elapsed = np.cumsum(gaps.astype(np.int64))
    elapsed -= np.repeat(elapsed[first], lengths)  # restart the clock at each user
    starts = START + rng.integers(0, START_SPREAD_S, size=num_users)
    timestamps = np.repeat(starts, lengths) + elapsed

    quality = rng.normal(0.0, 0.6, size=num_items)
    ratings = np.clip(np.rint(3.5 + quality[items] + rng.normal(0.0, 0.9, len(user))), 1, 5)
    actions = (
        int(Action.CLICK)
        + (ratings >= 4) * int(Action.LONG_VIEW)
        + (ratings == 5) * int(Action.LIKE)
        + (ratings == 1) * int(Action.HATE)
    )
    return SequenceDataset.from_events(
        "synthetic", user, items, timestamps, ratings=ratings, actions=actions
    )
