"""Bounded traffic-class domains: which acceptance statistics a request's OpenAI ``user`` shares.

Every distinct ``user`` value used to open its own traffic class, kept forever (600 users gave 602
classes in ``/v1/regimes`` and as many Prometheus label sets). Here at most ``capacity`` users
keep a class of their own: a user is promoted after ``promote_after`` requests, the least
recently seen named user is demoted when the table is full (its statistics are dropped), and
every other user shares one of ``buckets`` hashed classes (``~bucket-<i>``): rare users still pool
their evidence, and two bucket-mates mix only their acceptance, never their state. The number of
classes, and so of metric label sets, is at most 1 + capacity + buckets. A pure policy: the
caller owns the table and passes no clock (recency is request order).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_DOMAIN = "default"  # requests without a `user`
BUCKET_PREFIX = "~bucket-"  # not a valid-looking user name, so no user can claim a bucket's class


@dataclass(frozen=True)
class Assignment:
    domain: str  # the traffic-class domain this request counts under
    demoted: str | None = None  # a named domain pushed out by this request: its statistics are dropped


class DomainTable:
    def __init__(self, capacity: int = 64, buckets: int = 8, promote_after: int = 4):
        if capacity < 0 or buckets < 1 or promote_after < 1:
            raise ValueError("need capacity >= 0, buckets >= 1, promote_after >= 1")
        self.capacity = capacity
        self.buckets = buckets
        self.promote_after = promote_after
        self._named: OrderedDict[str, None] = OrderedDict()  # least recently seen first
        self._seen: OrderedDict[str, int] = OrderedDict()  # requests of not yet promoted users (bounded)

    def assign(self, user: str | None) -> Assignment:
        if not user or user == DEFAULT_DOMAIN:
            return Assignment(DEFAULT_DOMAIN)
        if user in self._named:
            self._named.move_to_end(user)
            return Assignment(user)
        count = self._seen.pop(user, 0) + 1
        if count < self.promote_after or self.capacity == 0:
            self._seen[user] = count
            if len(self._seen) > 4 * max(self.capacity, self.buckets):
                self._seen.popitem(last=False)
            return Assignment(self.bucket(user))
        demoted = None
        if len(self._named) >= self.capacity:
            demoted, _ = self._named.popitem(last=False)
        self._named[user] = None
        return Assignment(user, demoted)

    def bucket(self, user: str) -> str:
        """The shared class of a user without one of its own: stable across processes and restarts."""
        return f"{BUCKET_PREFIX}{zlib.crc32(user.encode()) % self.buckets}"

    @property
    def named(self) -> list[str]:
        return list(self._named)
